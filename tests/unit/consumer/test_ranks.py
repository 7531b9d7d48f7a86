"""consumer/ranks.py without torch.distributed: what rank 0 sends, in which
order, and what a follower does with it (the wire is replaced by a list)."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConsumerSettings
from common.errors import RankProtocolError
from consumer import ranks
from consumer.checkpoint import CheckpointState
from consumer.ranks import Follower, Leader, RankCommand


class FakeTrainer:
    def __init__(self, optimizer_state_sharded: bool = False, **parallel):
        self.cfg = ConsumerSettings(parallel=parallel)
        self.optimizer_state_sharded = optimizer_state_sharded
        self.calls: list = []

    def build_batch(self, samples, group_size):
        self.calls.append(("build_batch", samples, group_size))
        return samples

    def train_step(self, gb):
        self.calls.append(("train_step", gb))
        return {"loss": 0.0}

    def weight_source(self):
        self.calls.append(("export",))
        return FakeSource(self.calls)

    def state_dict(self):
        return {"model": {}}


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

    def audit(self, entry):
        self.calls.append(("audit", entry))

    def save(self, st, state):
        self.calls.append(("save", st.step))

    def begin(self, step):
        self.calls.append(("begin", step))
        return Path(f"/tmp/stage-{step}")

    def commit(self, tmp, st, shards):
        self.calls.append(("commit", str(tmp), st.step, shards))


@pytest.fixture
def wire(monkeypatch):
    """Every object rank 0 broadcasts, and what followers receive (a script)."""
    sent: list = []
    script: list = []
    monkeypatch.setattr(ranks, "broadcast", lambda obj=None: sent.append(obj) if obj is not None else script.pop(0))
    monkeypatch.setattr(ranks, "write_shard", lambda trainer, ckpt, tmp: ckpt.calls.append(("shard", str(tmp)))
                        or ["trainer-tp0-ep0.pt", "trainer-tp1-ep0.pt"])
    return sent, script


def test_commands_go_on_the_wire_as_plain_tuples():
    assert [c.value for c in RankCommand] == ["train", "checkpoint", "export", "stop"]


def test_alone_the_leader_sends_nothing(wire, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sent, _ = wire
    trainer, ckpt = FakeTrainer(tensor=2), FakeCheckpoints()
    leader = Leader(trainer, ckpt, group_size=4)
    leader.train(["s"])
    leader.checkpoint(CheckpointState(1, 1, {}), ["r1"])
    leader.export()
    leader.stop()
    assert sent == [] and not leader.sharded
    assert ckpt.calls == [("audit", {"step": 1, "version": 1, "trained": ["r1"]}), ("save", 1)]


def test_sharded_leader_announces_every_collective(wire, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    sent, _ = wire
    trainer, ckpt = FakeTrainer(tensor=2), FakeCheckpoints()
    leader = Leader(trainer, ckpt, group_size=4)
    assert leader.sharded
    assert leader.train(["s1", "s2"]) == {"loss": 0.0}
    leader.checkpoint(CheckpointState(3, 3, {0: 5}), ["r"])
    assert leader.export() == FakeSource([])  # rank 0 iterates it when it packs the version
    leader.stop()
    assert sent == [("train", ["s1", "s2"]), ("checkpoint", "/tmp/stage-3"), ("export", None), ("stop", None)]
    assert trainer.calls == [("build_batch", ["s1", "s2"], 4), ("train_step", ["s1", "s2"]), ("export",)]
    # the audit line first, then stage -> every rank's shard -> commit
    assert [c[0] for c in ckpt.calls] == ["audit", "begin", "shard", "commit"]
    assert ckpt.calls[-1] == ("commit", "/tmp/stage-3", 3, ["trainer-tp0-ep0.pt", "trainer-tp1-ep0.pt"])


def test_data_parallel_only_leader_checkpoints_and_exports_alone(wire, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    sent, _ = wire
    trainer, ckpt = FakeTrainer(), FakeCheckpoints()
    leader = Leader(trainer, ckpt, group_size=4)
    leader.train(["s"])
    leader.checkpoint(CheckpointState(1, 1, {}), [])
    leader.export()
    assert sent == [("train", ["s"])] and ("save", 1) in ckpt.calls


def test_distributed_optimizer_makes_the_checkpoint_collective_not_the_export(wire, monkeypatch):
    """dp only, optimizer state sharded over the data-parallel ranks: every rank
    gathers into the checkpoint; rank 0 still exports alone (whole weights)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    sent, _ = wire
    trainer, ckpt = FakeTrainer(optimizer_state_sharded=True), FakeCheckpoints()
    leader = Leader(trainer, ckpt, group_size=4)
    leader.checkpoint(CheckpointState(2, 2, {}), [])
    leader.export()
    assert sent == [("checkpoint", "/tmp/stage-2")]
    assert [c[0] for c in ckpt.calls] == ["audit", "begin", "shard", "commit"]


def test_follower_does_what_rank_0_sends_in_order_until_stop(wire, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    _, script = wire
    script += [("train", ["a"]), ("checkpoint", "/tmp/stage-1"), ("export", None), ("train", ["b"]), ("stop", None)]
    trainer, ckpt = FakeTrainer(tensor=2), FakeCheckpoints()
    assert Follower(trainer, ckpt, group_size=2).run() == 0
    assert trainer.calls == [("build_batch", ["a"], 2), ("train_step", ["a"]), ("export",), ("gather",),
                             ("build_batch", ["b"], 2), ("train_step", ["b"])]
    assert ckpt.calls == [("shard", "/tmp/stage-1")]
    assert script == []


def test_follower_refuses_a_command_it_does_not_know(wire, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    _, script = wire
    script += [("reload", None)]
    with pytest.raises(RankProtocolError, match="reload"):
        Follower(FakeTrainer(), FakeCheckpoints(), group_size=2).run()
