"""consumer/ranks/protocol.py without torch.distributed: what rank 0 sends, in which
order, and what a follower does with it (the channel is replaced by lists)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlstream.common.config import ConsumerSettings
from rlstream.common.errors import CheckpointError, RankProtocolError
from rlstream.consumer.checkpoint import writer
from rlstream.consumer.ranks import protocol as ranks
from rlstream.consumer.checkpoint.files import CheckpointState
from rlstream.consumer.ranks.protocol import WIRE_CODES, Follower, Leader, RankCommand

SHARDS = ["trainer-tp0-ep0.pt", "trainer-tp1-ep0.pt"]
OWN = ["optim-rank00000-of00002.pt", "optim-rank00001-of00002.pt"]


class FakeTrainer:
    def __init__(self, optimizer_state_sharded: bool = False, **parallel):
        self.cfg = ConsumerSettings(parallel=parallel)
        self.optimizer_state_sharded = optimizer_state_sharded
        self.calls: list = []
        self.weight = [1.0]  # a live tensor stand-in: training changes it in place

    def split_batch(self, samples, group_size):
        self.calls.append(("split", samples, group_size))
        return [f"share{d}:{samples}" for d in range(2)]

    def batch_from_share(self, share):
        self.calls.append(("batch_from_share", share))
        return share

    def train_step(self, gb):
        self.calls.append(("train_step", gb))
        self.weight[0] += 1
        return {"loss": 0.0}

    def weight_source(self):
        self.calls.append(("export",))
        return FakeSource(self.calls)

    def state_dict(self):
        self.calls.append(("state_dict",))
        return {"model": {"w": self.weight}, "optimizer": {"distributed": False, "parts": []}}


class FakeSource:
    """The trainer's weight source: rank 0 iterates it later; a follower at once."""

    def __init__(self, calls):
        self.calls = calls

    def iter_groups(self):
        self.calls.append(("gather",))
        yield ["w"], [None]

    def __eq__(self, other):
        return isinstance(other, FakeSource)


class FakeCheckpoints:
    def __init__(self):
        self.calls: list = []
        self.gate = threading.Event()  # the background write waits on it
        self.gate.set()

    def begin(self, step):
        self.calls.append(("begin", step))
        return Path(f"/tmp/stage-{step}")

    def write_shard(self, tmp, name, state):
        self.gate.wait(10)
        self.calls.append(("shard", str(tmp), name, state))

    def wait_for_shards(self, tmp, shards):
        self.calls.append(("wait_for_shards", str(tmp), shards))

    def commit(self, tmp, st, shards):
        self.calls.append(("commit", str(tmp), st.step, shards))


class FakeChannel:
    """What rank 0 sends, and a script of what a follower receives."""

    def __init__(self, script=()):
        self.sent: list = []
        self.script = list(script)

    def send(self, code, text=""):
        self.sent.append((list(RankCommand)[code].value, text))

    def send_shares(self, shares):
        self.sent.append(("shares", shares))

    def receive(self):
        cmd, text = self.script.pop(0)
        return (WIRE_CODES[RankCommand(cmd)] if cmd in {c.value for c in RankCommand} else 99), text

    def receive_share(self):
        return self.script.pop(0)


@pytest.fixture
def layout(monkeypatch):
    """checkpoint_shard without Megatron: rank 0 writes tp0's shard of a tp2 layout, and its own."""
    plan = writer.ShardPlan(SHARDS[0], True, OWN[0], SHARDS + OWN)
    monkeypatch.setattr(writer, "checkpoint_shard", lambda: plan)
    monkeypatch.setattr(ranks, "checkpoint_shard", lambda: plan)


def test_commands_have_fixed_wire_codes():
    assert [c.value for c in RankCommand] == ["train", "checkpoint", "export", "stop", "resume"]
    assert [WIRE_CODES[c] for c in RankCommand] == [0, 1, 2, 3, 4]


def test_alone_the_leader_sends_nothing_and_checkpoints_itself(layout, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trainer, ckpt = FakeTrainer(tensor=2), FakeCheckpoints()
    leader = Leader(trainer, ckpt, group_size=4)
    leader.train(["s"])
    leader.checkpoint(CheckpointState(1, 1, {}))
    leader.export()
    leader.stop()
    assert not leader.sharded and leader.channel is None
    assert trainer.calls[:3] == [("split", ["s"], 4), ("batch_from_share", "share0:['s']"),
                                 ("train_step", "share0:['s']")]
    assert [c[0] for c in ckpt.calls] == ["begin", "shard", "shard", "wait_for_shards", "commit"]


def test_sharded_leader_announces_every_collective_and_sends_each_rank_its_share(layout, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer, ckpt, ch = FakeTrainer(tensor=2), FakeCheckpoints(), FakeChannel()
    leader = Leader(trainer, ckpt, group_size=4, channel=ch)
    assert leader.sharded
    assert leader.train(["s1", "s2"]) == {"loss": 0.0}
    leader.checkpoint(CheckpointState(3, 3, {0: 5}))
    assert leader.export() == FakeSource([])  # rank 0 iterates it when it packs the version
    leader.stop()
    assert ch.sent == [("train", ""), ("shares", ["share0:['s1', 's2']", "share1:['s1', 's2']"]),
                       ("checkpoint", "/tmp/stage-3"), ("export", ""), ("stop", "")]
    # rank 0 trains on data-parallel share 0 only
    assert ("batch_from_share", "share0:['s1', 's2']") in trainer.calls
    # stage -> snapshot (every rank) -> this rank's files -> every file present -> commit
    assert [c[:3] for c in ckpt.calls[1:3]] == [("shard", "/tmp/stage-3", OWN[0]),
                                                ("shard", "/tmp/stage-3", SHARDS[0])]
    assert [c[0] for c in ckpt.calls] == ["begin", "shard", "shard", "wait_for_shards", "commit"]
    assert ckpt.calls[-1] == ("commit", "/tmp/stage-3", 3, SHARDS + OWN)


def test_data_parallel_only_leader_exports_alone_but_checkpoints_collectively(layout, monkeypatch):
    """The distributed optimizer's state lives on every data-parallel rank."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    trainer, ckpt, ch = FakeTrainer(), FakeCheckpoints(), FakeChannel()
    leader = Leader(trainer, ckpt, group_size=4, channel=ch)
    leader.train(["s"])
    leader.checkpoint(CheckpointState(1, 1, {}))
    leader.export()
    leader.stop()
    assert [m[0] for m in ch.sent] == ["train", "shares", "checkpoint", "stop"]


def test_the_snapshot_is_taken_at_the_boundary_and_written_while_training_goes_on(layout, monkeypatch):
    """The loop returns from checkpoint() before the write; the shard holds the
    state of the step boundary, not what training made of it since; the next
    checkpoint (and stop) waits for the write in flight."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trainer, ckpt = FakeTrainer(), FakeCheckpoints()
    leader = Leader(trainer, ckpt, group_size=4)
    ckpt.gate.clear()  # the write blocks
    leader.checkpoint(CheckpointState(1, 1, {}))
    assert leader.writes.busy and [c[0] for c in ckpt.calls] == ["begin"]
    leader.train(["s"])  # the weight moves on: 1.0 -> 2.0
    ckpt.gate.set()
    leader.checkpoint(CheckpointState(2, 2, {}))  # waits for the first to commit
    leader.stop()
    shards = [c for c in ckpt.calls if c[0] == "shard" and c[2] == SHARDS[0]]
    assert [s[3]["model"]["w"] for s in shards] == [[1.0], [2.0]]
    assert [c[0] for c in ckpt.calls] == ["begin", "shard", "shard", "wait_for_shards", "commit"] * 2


def test_a_failed_background_write_surfaces_at_the_next_checkpoint(layout, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trainer, ckpt = FakeTrainer(), FakeCheckpoints()

    def broken(*_):
        raise OSError("disk full")
    ckpt.write_shard = broken
    leader = Leader(trainer, ckpt, group_size=4)
    leader.checkpoint(CheckpointState(1, 1, {}))
    with pytest.raises(CheckpointError, match="disk full"):
        leader.checkpoint(CheckpointState(2, 2, {}))


def test_follower_does_what_rank_0_sends_in_order_until_stop(layout, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ch = FakeChannel([("train", ""), "share-a", ("checkpoint", "/tmp/stage-1"), ("export", ""),
                      ("train", ""), "share-b", ("stop", "")])
    trainer, ckpt = FakeTrainer(tensor=2), FakeCheckpoints()
    assert Follower(trainer, ckpt, ch).run() == 0
    assert trainer.calls == [("batch_from_share", "share-a"), ("train_step", "share-a"), ("state_dict",),
                             ("export",), ("gather",), ("batch_from_share", "share-b"), ("train_step", "share-b")]
    assert [c[:3] for c in ckpt.calls] == [("shard", "/tmp/stage-1", OWN[0]), ("shard", "/tmp/stage-1", SHARDS[0])]
    assert ch.script == []


@pytest.mark.parametrize("cmd", ["reload", "resume"])
def test_follower_refuses_a_command_it_does_not_expect(layout, monkeypatch, cmd):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RankProtocolError, match="unexpected command"):
        Follower(FakeTrainer(), FakeCheckpoints(), FakeChannel([(cmd, "")])).run()


def test_a_rank_that_does_not_write_its_pairs_shard_copies_and_writes_only_its_own(monkeypatch):
    """N7b: a rank's checkpoint snapshot is what it writes; the model shard stays with the
    pair's writer, and no rank copies another's optimizer state."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(writer, "checkpoint_shard", lambda: writer.ShardPlan(SHARDS[0], False, OWN[1], SHARDS + OWN))
    copied = []
    monkeypatch.setattr(writer, "host_copy", lambda obj: copied.append(obj) or obj)
    ch = FakeChannel([("checkpoint", "/tmp/stage-1"), ("stop", "")])
    trainer, ckpt = FakeTrainer(), FakeCheckpoints()
    assert Follower(trainer, ckpt, ch).run() == 0
    assert [c[:3] for c in ckpt.calls] == [("shard", "/tmp/stage-1", OWN[1])]
    assert [list(c) for c in copied] == [[OWN[1]]]  # never the model
