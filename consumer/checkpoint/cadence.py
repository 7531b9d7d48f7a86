"""Checkpoints on a cadence, written in the background after an in-memory snapshot.

    cadence = Cadence(cfg.consumer.checkpoint, step)   # every_steps / every_seconds
    if cadence.due(step):                              # after an optimizer step
        writes.wait()                                  # the previous write has committed
        snap = host_copy(trainer.state_dict())         # the loop blocks only for this copy
        writes.start(lambda: write_and_commit(snap))   # one write in flight, in a thread
        cadence.done(step)
    writes.wait()                                      # at shutdown

Why. A synchronous checkpoint after every step wrote model and optimizer
(about 248 GB per step at 30B-A3B on 8 shards, docs/trainer-scale.md) while
the GPUs idled. A crash now redoes the steps since the last checkpoint: the
ledger and reader offsets are committed with the model they produced
(consumer/stream/ledger.py), so the redone steps re-read their records and every
record is trained once in the lineage of the final model.

The snapshot is a deep copy whose tensors live on the host and own their
memory: training goes on changing the live parameters and optimizer state
while the copy is written. It holds only what this rank writes: its own shard
of the distributed optimizer's masters and moments, and its (tp, ep) pair's
model shard on the one rank per pair that writes it (consumer/ranks/protocol.py). No
rank gathers another's state any more, so the copy is the whole of the
blocking part, and a rank's host memory at a checkpoint is its own shards
(no expert-rank-0 rank holds the gathered state of its expert-data-parallel
group, so no node carries every expert shard's state).
On GPU the copies are device-to-host into pinned memory, issued non-blocking,
with one synchronise at the end. The writer thread issues no collective
(consumer/ranks/protocol.py commits once every rank's shard file is in place), and its
error surfaces at the next `wait()`.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from rlstream.common.config import CheckpointSettings
from rlstream.common.errors import CheckpointError


class Cadence:
    """Whether a checkpoint is due after a step: `every_steps` steps or
    `every_seconds` seconds since the last one (0 turns a trigger off)."""

    def __init__(self, settings: CheckpointSettings, step: int = 0, clock: Callable[[], float] = time.monotonic):
        self.settings, self.clock = settings, clock
        self.last_step, self.last_at = step, clock()

    def dirty(self, step: int) -> bool:
        """Steps were trained since the last checkpoint."""
        return step > self.last_step

    def due(self, step: int) -> bool:
        s = self.settings
        by_steps = s.every_steps > 0 and step - self.last_step >= s.every_steps
        by_time = s.every_seconds > 0 and self.clock() - self.last_at >= s.every_seconds
        return self.dirty(step) and (by_steps or by_time)

    def done(self, step: int) -> None:
        self.last_step, self.last_at = step, self.clock()


def host_copy(obj: Any) -> Any:
    """`obj` (dicts, lists, tuples, tensors, plain values) with every tensor copied
    to host memory that nothing else references. Device tensors go into one pinned
    slab registered for exactly their bytes (consumer/weights/snapshot.py HostSlab), not
    through torch's caching host allocator, which rounds each block up to a power of two
    and keeps its high-water mark pinned (a checkpoint's copy of a 30B model's state)."""
    import torch

    from rlstream.consumer.weights.snapshot import HostSlab  # defers torch

    device: list[torch.Tensor] = []
    _walk(obj, lambda x: device.append(x) if x.is_cuda else None)
    slab = HostSlab([x.numel() * x.element_size() for x in device], pin=True) if device else None
    views = iter(slab.views if slab is not None else [])

    def copy(x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return x.clone()
        out = next(views).view(x.dtype).view(x.shape)
        return out.copy_(x, non_blocking=True)

    out = _walk(obj, copy)
    if device:
        torch.cuda.synchronize()
    return out


def _walk(x: Any, leaf) -> Any:
    """`x` with `leaf(tensor)` in place of each (detached) tensor."""
    import torch

    if isinstance(x, torch.Tensor):
        return leaf(x.detach())
    if isinstance(x, dict):
        return {k: _walk(v, leaf) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_walk(v, leaf) for v in x)
    return x


class BackgroundWrite:
    """At most one checkpoint write in flight, in a daemon thread."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.waited_s = 0.0
        """Seconds `wait()` has blocked in all (the loop's share of checkpoint time)."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn: Callable[[], Any]) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the loop's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-write", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight (if any) is done; raises its error."""
        if self._thread is not None:
            t0 = time.monotonic()
            self._thread.join()
            self.waited_s += time.monotonic() - t0
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint write failed: {err}; the previous "
                                  "checkpoint is intact, a restart resumes from it") from err
