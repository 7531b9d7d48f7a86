"""The trainer's half of the collective weight path on one GPU (issue #15): the export
from CUDA parameters into the snapshot that every link streams (consumer/weights/snapshot.py).

Mirrors tests/integration/test_weight_link.py's snapshot checks on CPU: the packed
version holds exactly the trainer's HF export, and its digest is the one the same
tensors packed on the host give, so a producer verifying it accepts the bytes. On
CUDA the snapshot's buffers must be pinned (the device-to-host copy into pageable
memory measured 8.5 GB/s on an H100, into pinned 52 GB/s: tests/bench/weights_export.py).
Runs without vLLM (the snapshot does not import it).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.usefixtures("needs_megatron"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_snapshot_of_cuda_weights_is_pinned_and_carries_exactly_the_export(tiny_model_dir):
    from rlstream.common.config import ConsumerSettings
    from rlstream.common.weights import wire
    from rlstream.consumer.weights.snapshot import Snapshot
    from rlstream.consumer.train.trainer import Trainer

    trainer = Trainer.from_hf(tiny_model_dir, ConsumerSettings(dtype="bfloat16", group_size=1))
    assert trainer.device.type == "cuda"
    snap = Snapshot(1, trainer.weight_source())
    digest = snap.fill()
    assert all(buf.is_pinned() for buf in snap.buffers)
    export = {k: v.detach().cpu() for k, v in trainer.export_hf_state_dict().items()}
    got = snap.tensors()
    assert set(got) == set(export)
    for name, t in export.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    host = [wire.digest(wire.pack([export[n] for n in spec.names])) for spec in snap.header.groups]
    assert wire.version_digest(host).hex() == digest

    again = Snapshot(2, trainer.weight_source(), reuse=snap)  # the next version reuses the pinned buffers
    assert again.fill() == digest
    assert [b.data_ptr() for b in again.buffers] == [b.data_ptr() for b in snap.buffers]
