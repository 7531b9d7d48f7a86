"""The rank protocol under torchrun: rank 0 leads, every other rank follows.

Rank 0 (the consumer service) reads, gates and decides; the other ranks hold
a trainer and nothing else. Each collective (gradient all-reduce, checkpoint
barrier, weight gather) needs every rank, so rank 0 announces each one with a
command and every follower does the same work, in the same order:

    command     arg                     every rank
    TRAIN       list[TrainSample]       build its data-parallel share, train_step
    CHECKPOINT  staging dir (str)       gather its state (collective), write its (tp, ep) shard if
                                        it is the pair's writer; barrier
    EXPORT      None                    iterate the weight source (layer groups gathered to rank 0)
    STOP        None                    leave; rank 0 stopped at a batch boundary

CHECKPOINT and EXPORT are sent only when the ranks hold different shards
(tensor or expert parallel; CHECKPOINT also when the distributed optimizer
shards its state over data-parallel ranks): with data parallelism alone rank 0
holds the whole weights and exports by itself. Before the first command every rank
calls `start_rank`: rank 0 picks the newest checkpoint and broadcasts its
path, and each rank loads its own shard of it.

Wire: one `torch.distributed.broadcast_object_list` of `(command.value, arg)`
per command, from rank 0 (a later issue replaces it). In a world of one the
leader sends nothing.
"""
from __future__ import annotations

import logging
import signal
from enum import Enum
from pathlib import Path
from typing import Any

from common.config import RlstreamConfig
from common.errors import RankProtocolError
from consumer.checkpoint import CheckpointManager, CheckpointState, all_shard_names, shard_name
from consumer.parallel import launch_rank, launch_world_size, ranks, world

log = logging.getLogger("rlstream.consumer")


class RankCommand(str, Enum):
    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    EXPORT = "export"
    STOP = "stop"


def broadcast(obj: Any = None) -> Any:
    """Rank 0 sends `obj` to every rank (gloo/nccl object broadcast); returns it."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------- every rank


def start_rank(cfg: RlstreamConfig):
    """Collective, on every rank: build the trainer, then resume it from the
    checkpoint rank 0 picks. Returns (trainer, checkpoints, rank 0's
    (CheckpointState, path) or None: elsewhere, or when there is none)."""
    import torch

    from consumer.trainer import Trainer

    torch.set_num_threads(cfg.consumer.num_threads)
    trainer = Trainer.from_hf(cfg.model.path, cfg.consumer)
    ckpt = CheckpointManager(cfg.consumer.checkpoint_dir, cfg.consumer.keep_checkpoints)
    latest = ckpt.latest() if launch_rank() == 0 else None
    path = str(latest[1]) if latest else None
    if launch_world_size() > 1:  # every rank resumes from the checkpoint rank 0 chose
        path = broadcast(path)
    if path is not None:
        trainer.load_state_dict(ckpt.load_trainer_state(Path(path), checkpoint_shard()[0]))
    return trainer, ckpt, latest


def checkpoint_shard() -> tuple[str, bool, list[str]]:
    """(this rank's shard name, whether this rank writes it, every shard name).
    One rank per (tp rank, ep rank) pair writes: the first of its
    expert-data-parallel group (data-parallel copies are identical)."""
    from megatron.core import parallel_state as ps

    tp_rank, tp, ep_rank, ep = ranks()
    writes = world() == 1 or ps.get_expert_data_parallel_rank() == 0
    return shard_name(tp_rank, tp, ep_rank, ep), writes, all_shard_names(tp, ep)


def write_shard(trainer, ckpt: CheckpointManager, tmp: str | Path) -> list[str]:
    """Collective: this rank's trainer-state shard into `tmp` (if it is the
    writer of its (tp, ep) pair), then a barrier; returns every shard name."""
    import torch.distributed as dist

    name, writes, shards = checkpoint_shard()
    state = trainer.state_dict()  # collective: the distributed optimizer gathers its shards
    if writes:
        ckpt.write_shard(Path(tmp), name, state)
    dist.barrier()
    return shards


# ---------------------------------------------------------------- rank 0


class Leader:
    """Rank 0's side: does each step's trainer work and has the followers do theirs."""

    def __init__(self, trainer, ckpt: CheckpointManager, group_size: int):
        self.trainer, self.ckpt, self.group_size = trainer, ckpt, group_size
        self.world = launch_world_size()
        tp, ep = trainer.cfg.parallel.tensor, trainer.cfg.parallel.expert
        # several ranks holding different shards: every rank checkpoints and exports
        self.sharded = self.world > 1 and (tp > 1 or ep > 1)
        # the distributed optimizer spreads its state over data-parallel ranks too
        self.collective_checkpoint = self.sharded or trainer.optimizer_state_sharded

    def broadcast(self, cmd: RankCommand, arg: Any = None) -> None:
        if self.world > 1:
            broadcast((cmd.value, arg))

    def train(self, samples: list) -> dict[str, float]:
        self.broadcast(RankCommand.TRAIN, samples)
        return self.trainer.train_step(self.trainer.build_batch(samples, self.group_size))

    def checkpoint(self, st: CheckpointState, trained: list[str]) -> None:
        """The audit line of the step that trained `trained`, then trainer state +
        `st` committed atomically (every rank's shard when sharded)."""
        self.ckpt.audit({"step": st.step, "version": st.version, "trained": trained})
        if not self.collective_checkpoint:
            self.ckpt.save(st, self.trainer.state_dict())
            return
        tmp = self.ckpt.begin(st.step)
        self.broadcast(RankCommand.CHECKPOINT, str(tmp))
        self.ckpt.commit(tmp, st, write_shard(self.trainer, self.ckpt, tmp))

    def export(self):
        """The current weights as a WeightSource (consumer/weight_source.py) for rank 0 to
        iterate once; when sharded, every follower iterates it in step (EXPORT)."""
        if self.sharded:
            self.broadcast(RankCommand.EXPORT)
        return self.trainer.weight_source()

    def stop(self) -> None:
        self.broadcast(RankCommand.STOP)


# ---------------------------------------------------------------- ranks > 0


class Follower:
    """A rank > 0: the trainer, and what rank 0 broadcasts."""

    def __init__(self, trainer, ckpt: CheckpointManager, group_size: int):
        self.trainer, self.ckpt, self.group_size = trainer, ckpt, group_size
        self.rank, self.world = launch_rank(), launch_world_size()

    def run(self) -> int:
        """Until rank 0 sends STOP."""
        log.info("rank %d/%d following rank 0", self.rank, self.world)
        while True:
            kind, arg = broadcast(None)
            if kind == RankCommand.STOP.value:
                log.info("rank %d stopping with rank 0", self.rank)
                return 0
            self.dispatch(kind, arg)

    def dispatch(self, kind: str, arg: Any) -> None:
        if kind == RankCommand.TRAIN.value:
            self.trainer.train_step(self.trainer.build_batch(arg, self.group_size))
        elif kind == RankCommand.CHECKPOINT.value:
            write_shard(self.trainer, self.ckpt, arg)
        elif kind == RankCommand.EXPORT.value:
            for _ in self.trainer.weight_source().iter_groups():  # the gathers, in step with rank 0
                pass
        else:
            raise RankProtocolError(f"rank {self.rank}: unknown command {kind!r} from rank 0")


def run_follower(cfg: RlstreamConfig) -> int:
    """`rlstream consumer` on a rank > 0: no Kafka, only the trainer.

    SIGTERM/SIGINT are only noted: rank 0 stops at its next batch boundary and
    sends STOP, so every rank leaves between steps."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    trainer, ckpt, _ = start_rank(cfg)
    return Follower(trainer, ckpt, cfg.consumer.group_size).run()
