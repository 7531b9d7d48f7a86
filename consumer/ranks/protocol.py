"""The rank protocol under torchrun: rank 0 leads, every other rank follows.

Rank 0 (the consumer service) reads, gates and decides; the other ranks hold
a trainer and nothing else. Each collective (gradient reduction, checkpoint
snapshot, weight gather) needs every rank, so rank 0 announces each one with a
command and every follower does the same work, in the same order:

    command     what travels                every rank
    TRAIN       its own BatchShare          pad its mini-batches, train_step
    CHECKPOINT  the staging dir             copy its own state to host memory (no collective),
                                            write it in a thread: its optimizer shard, and
                                            its (tp, ep) pair's model shard if it writes it
    EXPORT      -                           iterate the weight source (layer groups gathered to rank 0)
    STOP        -                           wait for its checkpoint write, leave
    RESUME      checkpoint path ("": none)  (once, in start_rank) load its shard of it

Rank 0 computes the group advantages and global counts and cuts the batch
into one share per data-parallel rank (consumer/train/batch.py); each rank receives
only its own share, as a few flat tensors (consumer/ranks/shares.py), and builds its
mini-batches from it. Followers wait for commands on a gloo group on the host
(consumer/ranks/channel.py), never inside an NCCL collective while rank 0 waits on
Kafka. EXPORT is sent only when the ranks hold different weights (tensor or
expert parallel); CHECKPOINT always when there are several ranks (the
distributed optimizer spreads its state over data-parallel ranks too).

Checkpoints (when: consumer/checkpoint/cadence.py). Rank 0 waits until its previous
checkpoint has committed, creates the staging directory and sends CHECKPOINT,
so that every rank copies its state at the same step boundary. Each rank
copies only what it writes to host memory (the loop's only wait: its own
optimizer shard, plus the model shard of its (tp, ep) pair on the one rank per
pair that writes it; nothing is gathered) and writes it in a background
thread (consumer/checkpoint/writer.py); rank 0's thread waits for every file, then
commits (consumer/checkpoint/files.py). At
STOP every rank waits for its write. Before the first command every rank calls
`start_rank`: rank 0 picks the newest checkpoint and sends its path, and each
rank loads its own shard of it. In a world of one the leader sends nothing.
"""
from __future__ import annotations

import logging
import signal
from enum import Enum
from functools import partial
from pathlib import Path

from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import RankProtocolError
from rlstream.consumer.checkpoint.files import (
    CheckpointManager,
    CheckpointState,
)
from rlstream.consumer.checkpoint.writer import BackgroundWrite, checkpoint_shard, snapshot_shard
from rlstream.consumer.train.parallel import launch_rank, launch_world_size

log = logging.getLogger("rlstream.consumer")


class RankCommand(str, Enum):
    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    EXPORT = "export"
    STOP = "stop"
    RESUME = "resume"


WIRE_CODES = {c: i for i, c in enumerate(RankCommand)}
"""A command's code on the wire: its position in RankCommand (append only)."""


# ---------------------------------------------------------------- every rank


def start_rank(cfg: RlstreamConfig):
    """Collective, on every rank: build the trainer and the control channel, then
    resume the trainer from the checkpoint rank 0 picks. Returns (trainer,
    checkpoints, channel (None alone), rank 0's (CheckpointState, path) or None:
    elsewhere, or when there is none)."""
    import torch
    from megatron.core import parallel_state as ps

    from rlstream.consumer.ranks.channel import RankChannel  # defers torch
    from rlstream.consumer.train.trainer import Trainer  # defers torch

    torch.set_num_threads(cfg.consumer.num_threads)
    trainer = Trainer.from_hf(cfg.model.path, cfg.consumer)
    ckpt = CheckpointManager(cfg.consumer.checkpoint_dir, cfg.consumer.keep_checkpoints)
    latest = ckpt.latest() if launch_rank() == 0 else None
    path = str(latest[1]) if latest else ""
    channel = None
    if launch_world_size() > 1:  # every rank resumes from the checkpoint rank 0 chose
        channel = RankChannel(ps.get_data_parallel_rank())
        if launch_rank() == 0:
            channel.send(WIRE_CODES[RankCommand.RESUME], path)
        else:
            path = expect(channel, RankCommand.RESUME)
    if path:
        plan = checkpoint_shard()
        trainer.load_state_dict(ckpt.load_trainer_state(Path(path), plan.pair, plan.own))
    return trainer, ckpt, channel, latest


def expect(channel, cmd: RankCommand) -> str:
    """A follower's next command, which must be `cmd`; its text."""
    code, text = channel.receive()
    if code != WIRE_CODES[cmd]:
        raise RankProtocolError(f"rank {launch_rank()}: command {code} from rank 0, expected {cmd.value}")
    return text


# ---------------------------------------------------------------- rank 0


class Leader:
    """Rank 0's side: does each step's trainer work and has the followers do theirs."""

    def __init__(self, trainer, ckpt: CheckpointManager, group_size: int, channel=None):
        self.trainer, self.ckpt, self.group_size, self.channel = trainer, ckpt, group_size, channel
        self.world = launch_world_size()
        tp, ep = trainer.cfg.parallel.tensor, trainer.cfg.parallel.expert
        # several ranks holding different weights: every rank exports
        self.sharded = self.world > 1 and (tp > 1 or ep > 1)
        self.writes = BackgroundWrite()

    def send(self, cmd: RankCommand, text: str = "") -> None:
        if self.channel is not None:
            self.channel.send(WIRE_CODES[cmd], text)

    def train(self, samples: list) -> dict[str, float]:
        """One step on every rank; each rank gets its own data-parallel share."""
        shares = self.trainer.split_batch(samples, self.group_size)
        if self.channel is not None:
            self.send(RankCommand.TRAIN)
            self.channel.send_shares(shares)
        return self.trainer.train_step(self.trainer.batch_from_share(shares[0]))  # rank 0 is dp rank 0

    def checkpoint(self, st: CheckpointState) -> None:
        """Trainer state + `st`, committed atomically in the background once every
        rank's shard is written. Blocks while the previous checkpoint is in flight,
        then for the snapshot only."""
        self.writes.wait()
        tmp = self.ckpt.begin(st.step)
        self.send(RankCommand.CHECKPOINT, str(tmp))
        shards = checkpoint_shard().every
        snapshot_shard(self.trainer, self.ckpt, self.writes, tmp, commit=partial(self._commit, tmp, st, shards))

    def _commit(self, tmp: Path, st: CheckpointState, shards: list[str]) -> None:
        self.ckpt.wait_for_shards(tmp, shards)
        self.ckpt.commit(tmp, st, shards)

    def export(self):
        """The current weights as a WeightSource (consumer/train/export.py) for rank 0 to
        iterate once; when sharded, every follower iterates it in step (EXPORT)."""
        if self.sharded:
            self.send(RankCommand.EXPORT)
        return self.trainer.weight_source()

    def stop(self) -> None:
        """Wait for the checkpoint in flight to commit, then release the followers."""
        try:
            self.writes.wait()
        finally:
            self.send(RankCommand.STOP)


# ---------------------------------------------------------------- ranks > 0


class Follower:
    """A rank > 0: the trainer, and what rank 0 sends."""

    def __init__(self, trainer, ckpt: CheckpointManager, channel):
        self.trainer, self.ckpt, self.channel = trainer, ckpt, channel
        self.rank, self.world = launch_rank(), launch_world_size()
        self.writes = BackgroundWrite()

    def run(self) -> int:
        """Until rank 0 sends STOP."""
        log.info("rank %d/%d following rank 0", self.rank, self.world)
        commands = list(RankCommand)
        while True:
            code, text = self.channel.receive()
            if not 0 <= code < len(commands) or commands[code] == RankCommand.RESUME:
                raise RankProtocolError(f"rank {self.rank}: unexpected command {code} from rank 0 "
                                        "(the ranks run different rlstream versions? restart them all "
                                        "from one install)")
            if commands[code] == RankCommand.STOP:
                self.writes.wait()
                log.info("rank %d stopping with rank 0", self.rank)
                return 0
            self.dispatch(commands[code], text)

    def dispatch(self, cmd: RankCommand, text: str) -> None:
        if cmd == RankCommand.TRAIN:
            self.trainer.train_step(self.trainer.batch_from_share(self.channel.receive_share()))
        elif cmd == RankCommand.CHECKPOINT:
            snapshot_shard(self.trainer, self.ckpt, self.writes, Path(text))
        elif cmd == RankCommand.EXPORT:
            for _ in self.trainer.weight_source().iter_groups():  # the gathers, in step with rank 0
                pass


def run_follower(cfg: RlstreamConfig) -> int:
    """`rlstream consumer` on a rank > 0: no Kafka, only the trainer.

    SIGTERM/SIGINT are only noted: rank 0 stops at its next batch boundary and
    sends STOP, so every rank leaves between steps."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    trainer, ckpt, channel, _ = start_rank(cfg)
    return Follower(trainer, ckpt, channel).run()
