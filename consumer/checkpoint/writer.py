"""A rank's share of a checkpoint: which files it writes, the copy of them in host memory,
and the one background write in flight (when: cadence.py; the files: files.py).

    plan = checkpoint_shard()          # this rank's files: its own, and its (tp, ep) pair's if it writes it
    snapshot_shard(trainer, ckpt, writes, tmp, commit)   # wait, copy to host, write in a thread

The snapshot is a deep copy whose tensors live on the host and own their memory: training
goes on changing the live parameters and optimizer state while the copy is written. It holds
only what this rank writes, so the copy is the whole of the blocking part and a rank's host
memory at a checkpoint is its own shards. On GPU the copies are device-to-host into pinned
memory, issued non-blocking, with one synchronise at the end. The writer thread issues no
collective (rank 0 commits once every rank's shard file is in place: consumer/ranks/protocol.py),
and its error surfaces at the next `wait()`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlstream.common.errors import CheckpointError
from rlstream.consumer.checkpoint.files import CheckpointManager, all_shard_names, rank_shard_name, shard_name
from rlstream.consumer.train.parallel import launch_rank, ranks, world


@dataclass(frozen=True)
class ShardPlan:
    """The files of this rank's trainer state in a checkpoint (consumer/checkpoint/files.py)."""
    pair: str            # its (tp, ep) pair's shard: model + the optimizer state ranks share
    writes_pair: bool    # this rank writes `pair` (one rank per pair)
    own: str             # its own file: its shard of the distributed optimizer's state
    every: list[str]     # every file of a complete checkpoint (rank 0 commits on them)


def checkpoint_shard() -> ShardPlan:
    """This rank's files. One rank per (tp rank, ep rank) pair writes the pair's
    shard: the first of its expert-data-parallel group (data-parallel copies of
    the model are identical); every rank writes its own file."""
    from megatron.core import parallel_state as ps

    tp_rank, tp, ep_rank, ep = ranks()
    writes = world() == 1 or ps.get_expert_data_parallel_rank() == 0
    return ShardPlan(shard_name(tp_rank, tp, ep_rank, ep), writes, rank_shard_name(launch_rank(), world()),
                     all_shard_names(tp, ep, world()))


def snapshot_shard(trainer, ckpt: CheckpointManager, writes: BackgroundWrite, tmp: Path,
                   commit=None) -> None:
    """Wait for this rank's previous write, copy what this rank writes to host
    memory (the only part that blocks; no collective), and write the copies into
    `tmp` in the background; then `commit()` in the same thread (rank 0)."""
    from rlstream.consumer.train.optimizer import split_rank_state  # defers torch

    writes.wait()
    plan = checkpoint_shard()
    state = trainer.state_dict()  # live references: copied below, before the next step
    state["optimizer"], own = split_rank_state(state["optimizer"])
    files = {plan.own: own, **({plan.pair: state} if plan.writes_pair else {})}
    snap = host_copy(files)  # this rank's own shards only: never another rank's

    def write() -> None:
        for name, part in snap.items():
            ckpt.write_shard(tmp, name, part)
        if commit is not None:
            commit()
    writes.start(write)


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
