"""A crash redoes its steps (issue 24.2): the records of the steps lost between
checkpoints are trained again into the restored model, judged as when first gated.

The real Ledger, CheckpointManager (its audit and version files in a temp dir)
and gate, driven the way ConsumerService drives them: gate at the step about to
be trained, audit each trained step, checkpoint on a cadence; then a "crash"
(the in-memory state is dropped), a restart that renumbers the restored model
above the dead versions (consumer/service.py `_continue_versions`), and the
re-read records gated again.
"""
from __future__ import annotations

import numpy as np
import pytest

from rlstream.common.config import ControlSettings
from rlstream.common.record import Rollout
from rlstream.consumer.stream.assembler import GroupAssembler
from rlstream.consumer.checkpoint.files import CheckpointManager
from rlstream.consumer.stream.ledger import Ledger
from rlstream.consumer.service import _gate_clock
from rlstream.consumer.stream.gate import GateClock, gate_group

G, MAX_STALENESS = 2, 1
STATE = ControlSettings(max_staleness=MAX_STALENESS, mode="drop")


def group(gid: str, version: int) -> list[Rollout]:
    return [Rollout(rollout_id=f"{gid}-{i}", group_id=gid, sample_idx=i, group_size=G,
                    prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3], np.int32),
                    logprobs=np.array([-0.5], np.float32), policy_version=version, reward=float(i))
            for i in range(G)]


class Item:
    def __init__(self, offset: int, r: Rollout):
        self.partition, self.offset, self.rollout = 0, offset, r


class Incarnation:
    """The service's gating and bookkeeping, one group per step (B = 1)."""

    def __init__(self, ckpt: CheckpointManager, run: str, step=0, version=0, ledger=None, clock=None):
        self.ckpt, self.run, self.step, self.version = ckpt, run, step, version
        self.ledger = ledger or Ledger(GroupAssembler(G, 60.0))
        self.clock = clock or GateClock()

    def read(self, topic: list[Rollout], start: int) -> None:
        self.ledger.read([Item(o, topic[o]) for o in range(start, len(topic))])

    def step_once(self) -> str:
        """Gate the oldest complete group at this step; train it (audit line) if kept."""
        g = self.ledger.take()
        d = gate_group(g.rollouts(), self.version, STATE, staleness=self.clock.staleness(self.step))
        if not d.keep:
            self.ledger.drop(g, d.outcome)
            return d.outcome
        self.step += 1
        self.version += 1
        self.ckpt.audit({"step": self.step, "version": self.version, "trained": self.ledger.trained(),
                         "run": self.run})
        return "trained"


def live_run_then_crash(tmp_path, topic: list[Rollout], steps: int, checkpoint_at: int):
    """Steps 1..`steps`, each fed a fresh group; a checkpoint after step `checkpoint_at`;
    then the process dies (everything after the checkpoint is lost but the audit log)."""
    ckpt = CheckpointManager(tmp_path)
    live = Incarnation(ckpt, "dead")
    st = None
    for s in range(steps):
        topic += group(f"g{s}", live.version)  # a producer stamps the newest version
        live.read(topic, len(topic) - G)
        assert live.step_once() == "trained"
        if live.step == checkpoint_at:
            st = live.ledger.to_checkpoint(live.step, live.version, {0: len(topic)})
    return ckpt, st, live.version


def restart(ckpt: CheckpointManager, st, newest_announced: int) -> Incarnation:
    """ConsumerService._restore + _continue_versions."""
    ledger = Ledger.from_checkpoint(st, GroupAssembler(G, 60.0))
    inc = Incarnation(ckpt, "redo", st.step, st.version, ledger, _gate_clock(ckpt, st))
    if newest_announced > inc.version:
        inc.version = newest_announced + 1
        ckpt.note_version(inc.version, inc.step)
        inc.clock.anchor(inc.version, inc.step)
    return inc


def test_the_lost_steps_are_trained_again_not_dropped_as_stale(tmp_path):
    topic: list[Rollout] = []
    ckpt, st, newest = live_run_then_crash(tmp_path, topic, steps=6, checkpoint_at=2)
    assert (st.step, newest) == (2, 6)
    redo = restart(ckpt, st, newest)
    assert redo.version == 7  # above every dead version: the gap is 5 versions, 4 lost steps
    redo.read(topic, st.offsets[0])  # the reader re-reads from the checkpoint's offsets
    outcomes = [redo.step_once() for _ in range(4)]
    assert outcomes == ["trained"] * 4, (outcomes, redo.ledger.counters)
    assert redo.step == 6 and redo.ledger.counters == {**st.counters, "trained": 6 * G}


def test_a_redone_record_is_judged_at_the_step_it_was_first_gated_at(tmp_path):
    """The redo may gate a group later than the live run did (the re-read interleaves
    partitions differently); it is judged where it was first gated, not later."""
    topic: list[Rollout] = []
    ckpt, st, newest = live_run_then_crash(tmp_path, topic, steps=4, checkpoint_at=1)
    clock = _gate_clock(ckpt, st)
    g3 = group("g3", 3)  # trained at step 4, gated at step 3
    assert clock.first_gated["g3-0"] == 3
    assert clock.staleness(3 + MAX_STALENESS + 2)(g3[0]) == 0
    assert gate_group(g3, 99, STATE, staleness=clock.staleness(9)).keep
    # a record of the same version not gated before the crash ages normally, in steps
    assert clock.staleness(9)(group("new", 3)[0]) == 6


def test_versions_map_to_the_steps_whose_models_they_were(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    ckpt.note_version(9, 4)  # crash 1: checkpoint of step 4, versions up to 8 announced
    ckpt.note_version(15, 6)  # crash 2: checkpoint of step 6, versions up to 14 announced
    with open(tmp_path / "versions.jsonl", "a") as f:
        f.write('{"version": 20, "st')  # torn by a kill mid-write: skipped
    clock = GateClock(ckpt.version_anchors())
    assert [clock.step_of(v) for v in (0, 4, 8)] == [0, 4, 8]  # the first incarnation: version = step
    assert [clock.step_of(v) for v in (9, 10, 14)] == [4, 5, 9]  # the second, from its restored model
    assert [clock.step_of(v) for v in (15, 16)] == [6, 7]
    # without a crash, staleness in steps is staleness in versions
    assert GateClock().staleness(5)(group("a", 3)[0]) == 2


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_audit_since_reads_only_the_lines_after_the_checkpoint_step(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr("rlstream.consumer.checkpoint.files.AUDIT_CHUNK", chunk)
    ckpt = CheckpointManager(tmp_path)
    for run, steps in (("a", range(1, 6)), ("b", range(4, 8))):  # b resumed at 3; then a checkpoint at 6
        for s in steps:
            ckpt.audit({"step": s, "version": s, "trained": [f"{run}{s}"], "run": run})
    with open(tmp_path / "trained.jsonl", "a") as f:
        f.write('{"step": 8, "trai')  # torn
    assert [e["trained"] for e in ckpt.audit_since(6)] == [["b7"]]
    assert [e["step"] for e in ckpt.audit_since(3)] == [4, 5, 4, 5, 6, 7]  # a's 4 and 5 died too
    assert ckpt.audit_since(99) == []
    assert CheckpointManager(tmp_path / "empty").audit_since(0) == []


def test_a_crash_during_the_redo_keeps_the_first_gating_of_what_is_still_held(tmp_path):
    """Crash 1 lost step 4 (it trained x, gated at step 3); the redo put x into a later batch and
    checkpointed step 5 before training it; crash 2. The audit lines after step 5 do not name x:
    the checkpoint does, so the second redo judges x at step 3 too."""
    from rlstream.consumer.checkpoint.files import CheckpointState

    ckpt = CheckpointManager(tmp_path)
    ckpt.audit({"step": 4, "version": 4, "trained": ["x"], "run": "a"})  # lost at crash 1
    redo_1 = Incarnation(ckpt, "b", 3, 5, clock=_gate_clock(ckpt, CheckpointState(3, 3, {0: 0})))
    assert redo_1.clock.first_gated == {"x": 3}
    redo_1.clock.trained(["y"])  # steps 4 and 5 of the redo trained others; x still held
    st = CheckpointState(5, 7, {0: 0}, first_gated=dict(redo_1.clock.first_gated))
    assert _gate_clock(ckpt, st).first_gated == {"x": 3}
    assert _gate_clock(ckpt, CheckpointState(5, 7, {0: 0})).first_gated == {}  # what it would lose
    redo_1.clock.trained(["x"])  # once trained in the lineage, it is no redo's business
    assert redo_1.clock.first_gated == {}
