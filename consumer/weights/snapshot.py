"""One weight version packed for sending: a host buffer and a blake3 digest per layer group.

    snap = Snapshot(version, source)   # source: trainer.weight_source() or any WeightSource
    snap.fill()                        # pack + hash group by group (collective on every rank)
    for buf, digest in snap.groups():  # any thread: each group as soon as it is packed
        ...

Filled once per version on the training thread and read by every link
(consumer/weights/gloo.py, consumer/weights/nccl.py) and the durable writer (consumer/weights/durable.py) on their
own threads: a group goes out as soon as it is packed and its digest follows
once hashed, so packing, hashing and sending overlap. It holds the version in
host memory (1x the weights' bytes on rank 0) until the next one replaces it,
so a producer that joins late gets the current version at once. The bytes are
common/weights/wire.py's.

Host memory: the groups are views into one slab (`HostSlab`), sized by
`slab_plan` to the weights' bytes plus page alignment, reused by the next
version. A slab for GPU tensors is pinned by registering exactly its pages
(cudaHostRegister), not through torch's caching host allocator, which rounds
every block up to a power of two: one pinned buffer per group took ~105 GB
for 61 GB of weights (a 1.25 GB group takes 2 GiB).

No vLLM import: the trainer's export and pack run (and are benchmarked,
tests/bench/weights_export.py) where vLLM is not installed.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights import wire


class Snapshot:
    """One version, packed group by group; readable while it fills (see the module doc)."""

    def __init__(self, version: int, source, reuse: "Snapshot | None" = None):
        self.version, self.source = version, source
        meta = {m.name: m for m in source.metadata()}
        self.header = wire.VersionHeader(version, [
            wire.GroupSpec.of(g, [meta[n].dtype for n in g], [meta[n].shape for n in g]) for g in source.groups()])
        n = len(self.header.groups)
        self.buffers: list[torch.Tensor | None] = [None] * n
        self.digests: list[bytes | None] = [None] * n
        self.digest: str | None = None
        """The version digest (hex), once filled."""
        self.error: BaseException | None = None
        self.fill_seconds = 0.0
        sizes = [spec.nbytes for spec in self.header.groups]
        self.slab: HostSlab | None = None
        """Where the groups live; allocated at the first group (pinned if the source is on a GPU)."""
        if reuse is not None and reuse.idle() and reuse.slab is not None and reuse.slab.sizes == sizes:
            self.slab = reuse.slab  # warm pages, already pinned
        self._cond = threading.Condition()
        self._users = 0

    def fill(self) -> str:
        """Pack and hash every group (iterates the source: a collective on every trainer
        rank); returns the version digest. Readers see each group as it lands."""
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstream-hash") as hasher:
                hashed = []
                for g, (names, tensors) in enumerate(self.source.iter_groups()):
                    if self.slab is None:
                        self.slab = HostSlab([spec.nbytes for spec in self.header.groups],
                                             pin=any(t.is_cuda for t in tensors))
                    buf = wire.pack(tensors, out=self.slab.views[g])
                    self._set(self.buffers, g, buf)
                    hashed.append(hasher.submit(self._hash, g, buf))
                for f in hashed:
                    f.result()
            digest = wire.version_digest(self.digests).hex()
        except BaseException as e:
            with self._cond:
                self.error = e
                self._cond.notify_all()
            raise
        with self._cond:
            self.digest = digest
            self.fill_seconds = time.perf_counter() - t0
            self._cond.notify_all()
        return digest

    def _hash(self, g: int, buf: torch.Tensor) -> None:
        self._set(self.digests, g, wire.digest(buf))

    def _set(self, slots: list, g: int, value) -> None:
        with self._cond:
            slots[g] = value
            self._cond.notify_all()

    def _get(self, slots: list, g: int, timeout_s: float):
        with self._cond:
            if not self._cond.wait_for(lambda: slots[g] is not None or self.error is not None, timeout_s):
                raise WeightTransferError(f"version {self.version}: group {g} not packed within {timeout_s:.0f} s")
            if self.error is not None:
                raise WeightTransferError(f"version {self.version} could not be exported: {self.error}")
            return slots[g]

    def groups(self, timeout_s: float = 600.0) -> Iterator[tuple[torch.Tensor, Any]]:
        """(buffer, digest getter) per group, as `send_version` wants them; blocks for each."""
        for g in range(len(self.header.groups)):
            yield self._get(self.buffers, g, timeout_s), (lambda g=g: self._get(self.digests, g, timeout_s))

    def wait(self, timeout_s: float = 600.0) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: self.digest is not None or self.error is not None, timeout_s):
                raise WeightTransferError(f"version {self.version} not packed within {timeout_s:.0f} s")
            if self.error is not None:
                raise WeightTransferError(f"version {self.version} could not be exported: {self.error}")
            return self.digest

    def tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor (views of the buffers) of the filled version."""
        self.wait()
        return {n: t for spec, buf in zip(self.header.groups, self.buffers) for n, t in wire.unpack(buf, spec)}

    # readers hold the snapshot while they read it, so its buffers are reused only once idle
    def acquire(self) -> "Snapshot":
        with self._cond:
            self._users += 1
        return self

    def release(self) -> None:
        with self._cond:
            self._users -= 1

    def idle(self) -> bool:
        with self._cond:
            return self._users == 0 and self.digest is not None


# ---------------------------------------------------------------- host memory

SLAB_ALIGN = 4096
"""Each group starts on a page: typed views of any dtype stay aligned, and pinning is per page."""


def slab_plan(sizes: list[int], align: int = SLAB_ALIGN) -> tuple[list[int], int]:
    """Offsets of groups of `sizes` bytes in one slab, and the slab's bytes (the sum of the
    sizes plus under `align` bytes of padding per group). Shared by the CPU and GPU paths:
    only the pinning differs."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    return offsets, end


class HostSlab:
    """One host allocation for a whole version, a uint8 view per group (see the module doc).

    Pinned slabs are registered with CUDA for exactly their bytes and unregistered
    when the memory is freed: the slab is a numpy allocation that every tensor on it
    keeps alive (torch.from_numpy), so a view (of a view) outliving the slab object keeps
    it registered. (A weakref to the base tensor's Python object did not: it dies with
    the slab object while views still use the memory.)"""

    def __init__(self, sizes: list[int], pin: bool = False):
        self.sizes = list(sizes)
        offsets, self.nbytes = slab_plan(self.sizes)
        memory = np.empty(self.nbytes, dtype=np.uint8)
        self.tensor = torch.from_numpy(memory)
        self.pinned = pin and self.nbytes > 0
        if self.pinned:
            _register_pinned(memory)
        self.views = [self.tensor[o:o + n] for o, n in zip(offsets, self.sizes)]


def _register_pinned(memory: np.ndarray) -> None:
    """Page-lock `memory` for fast device copies, unlocked when it is freed."""
    cudart = torch.cuda.cudart()
    ptr = memory.ctypes.data
    err = int(cudart.cudaHostRegister(ptr, memory.nbytes, 0))
    if err != 0:
        raise WeightTransferError(f"pinning the {memory.nbytes / 1e9:.1f} GB weight snapshot failed (cudaError "
                                  f"{err}): not enough lockable host memory? (ulimit -l, the pod's memory limit)")
    # unregistered by the runtime that registered it, whatever torch.cuda.cudart() is when the
    # memory is freed (under the GPU stand-in, a slab freed after the stand-in was removed
    # stayed registered, and a new slab at the same address was refused: cudaError 712)
    weakref.finalize(memory, cudart.cudaHostUnregister, ptr)
