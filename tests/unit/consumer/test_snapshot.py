"""The snapshot's host memory (consumer/weights/snapshot.py): one slab per version, sized to the
weights' bytes (N7a: one pinned buffer per group, rounded up to a power of two by torch's
caching host allocator, took ~105 GB for 61 GB). Pinning itself needs a GPU: here CUDA's
register/unregister calls are recorded by a fake `cudart`."""
from __future__ import annotations

import gc

import pytest
import torch

from rlstream.consumer.weights import snapshot as snapshot_mod
from rlstream.consumer.weights.snapshot import HostSlab, Snapshot, slab_plan
from tests.support.weights import dict_source

GB = 10**9


def test_a_qwen3_sized_version_plans_at_most_1_1x_its_bytes_in_host_memory():
    # 48 layer groups of ~1.25 GB plus embedding and head (odd sizes): ~61 GB, as in the review
    sizes = [1_251_000_123] * 48 + [1_244_659_712, 1_244_659_712, 8192]
    offsets, total = slab_plan(sizes)
    assert total <= 1.1 * sum(sizes)
    assert all(o % 4096 == 0 for o in offsets)
    assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(sizes) - 1))  # no overlap
    assert offsets[-1] + sizes[-1] <= total


def tensors_of(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    # odd element counts and mixed dtypes: groups that are not page multiples
    return {f"model.layers.{i}.w": torch.randn(1000 + 37 * i, generator=g).to(torch.bfloat16 if i % 2 else torch.float)
            for i in range(n)}


def test_a_filled_snapshot_keeps_every_group_in_one_slab_of_about_the_weights_bytes():
    ts = tensors_of(5)
    snap = Snapshot(1, dict_source(ts))
    snap.fill()
    storages = {b.untyped_storage().data_ptr() for b in snap.buffers}
    assert storages == {snap.slab.tensor.data_ptr()}  # one allocation, not one per group
    assert snap.slab.nbytes <= 1.1 * snap.header.nbytes + 4096 * len(snap.buffers)
    assert all(torch.equal(snap.tensors()[k], v) for k, v in ts.items())
    again = Snapshot(2, dict_source(tensors_of(5)), reuse=snap)
    again.fill()
    assert again.slab is snap.slab  # the next version writes into the warm slab


class FakeCudart:
    def __init__(self):
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_a_pinned_slab_registers_exactly_its_bytes_once_and_unregisters_when_freed(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    sizes = [12_510_001, 5, 1 << 20]
    slab = HostSlab(sizes, pin=True)
    ptr = slab.tensor.data_ptr()
    assert cudart.registered == [(ptr, slab_plan(sizes)[1])]  # exact: not rounded to 16 MiB + 8 B + 1 MiB
    view = slab.views[2]
    del slab
    gc.collect()
    assert cudart.unregistered == []  # a view still reads it
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_a_slab_that_cannot_be_pinned_says_why(monkeypatch):
    cudart = FakeCudart()
    cudart.cudaHostRegister = lambda ptr, n, flags: 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(snapshot_mod.WeightTransferError, match="pinning .* failed"):
        HostSlab([4096], pin=True)


def test_a_pinned_slab_stays_registered_while_any_view_of_it_lives():
    """cudaHostRegister (the GPU stand-in's, common/gpu_standin/cuda.py): registered for the slab's
    bytes, unregistered only when the last tensor on its memory is gone, not with the slab object."""
    import gc

    import torch

    from rlstream.common import gpu_standin
    from rlstream.common.gpu_standin import cuda
    from rlstream.consumer.weights.snapshot import HostSlab

    with gpu_standin.installed():
        gc.collect()  # an earlier test's slab, collected mid-test, would change the count below
        before = set(cuda.pinned.registered)
        slab = HostSlab([100, 200], pin=True)
        ours = set(cuda.pinned.registered) - before
        assert len(ours) == 1, "the slab's bytes are registered once"
        view = slab.views[1].view(torch.float32)
        del slab
        gc.collect()
        assert ours <= set(cuda.pinned.registered), "unregistered while a view still uses it"
        del view
        gc.collect()
        assert not ours & set(cuda.pinned.registered)


def test_a_slab_freed_after_the_stand_in_is_removed_is_unregistered_from_it():
    """The finalizer unregisters with the runtime that registered: a slab outliving the GPU
    stand-in stayed in its accounting, and a later slab at the same address got cudaError 712."""
    import gc

    from rlstream.common import gpu_standin
    from rlstream.common.gpu_standin import cuda
    from rlstream.consumer.weights.snapshot import HostSlab

    with gpu_standin.installed():
        gc.collect()
        before = set(cuda.pinned.registered)
        slab = HostSlab([64, 64], pin=True)
        ours = set(cuda.pinned.registered) - before
    assert len(ours) == 1
    del slab
    gc.collect()
    assert not ours & set(cuda.pinned.registered)
