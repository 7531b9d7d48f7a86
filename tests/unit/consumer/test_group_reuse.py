"""A reused group_id: refused in the assembler, never mixed, never trained twice.

Examples of each rule (consumer/stream/assembler.py), then a hypothesis property
test that drives the assembler and the ledger with arbitrary interleavings of
copies of a few group ids, partial copies, publisher retries, timeouts (a fake
clock) and restarts (a new assembler and ledger from what the last checkpoint
holds, the reader back at its offsets), playing the service's loop (read, gate,
train, checkpoint). Checked: no exception; every record read ends in exactly
one outcome; no group is assembled from two copies (a copy: the records of
one producer under one group id); no group id completes (trained or dropped)
twice in the lineage of the final model; a batch never holds two groups under one id (what
consumer/train/batch.py asserts).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.common.kafka.reader import ReadItem as Item
from rlstream.common.record import Rollout
from rlstream.consumer.stream.assembler import GroupAssembler
from rlstream.consumer.train.batch import TrainSample, group_advantages
from rlstream.consumer.checkpoint.files import CheckpointState
from rlstream.consumer.stream.ledger import OUTCOMES, Ledger
from tests.support.ledger_records import G, copy, read_all, rollout

TIMEOUT_S = 10.0


# ---------------------------------------------------------------- the rules, by example


def test_a_second_copy_while_the_first_waits_for_its_batch_is_refused_not_a_crash():
    """The crash this rule fixed: two complete groups under one id in one batch (16 samples, expected 8)."""
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S))
    read_all(ledger, copy("g", "a") + copy("g", "b"))
    assert [g.group_id for g in ledger.complete] == ["g"]
    refused = ledger.take_refused()
    assert [it.rollout.producer_id for it, _ in refused] == ["b"] * G
    assert all("group_id 'g'" in why for _, why in refused)
    assert ledger.counters["dlq"] == G and ledger.held_records() == G
    g = ledger.take()
    samples = [TrainSample.from_rollout(r) for r in g.rollouts()]
    group_advantages(samples, G)  # the batch's guard: one group of G under this id
    ledger.trained()


def test_interleaved_copies_never_make_one_group():
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S))
    a, b = copy("g", "a"), copy("g", "b")
    read_all(ledger, [a[0], a[1], b[2], b[3], b[0], a[2], a[3], b[1]])
    (g,) = ledger.complete
    assert {r.producer_id for r in g.rollouts()} == {"a"}
    assert sorted(it.offset for it, _ in ledger.take_refused()) == [2, 3, 4, 7]


def test_a_second_copy_of_one_producer_on_a_held_slot_is_refused():
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S))
    read_all(ledger, [rollout("g", 0, "a"), rollout("g", 0, "a", rid="again")])
    ((it, why),) = ledger.take_refused()
    assert it.rollout.rollout_id == "again" and "second copy" in why
    assert ledger.counters["dlq"] == 1 and ledger.counters["duplicate"] == 0


def test_a_publisher_retry_is_still_a_duplicate():
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S))
    read_all(ledger, [rollout("g", 0, "a"), rollout("g", 0, "a")])
    assert ledger.counters["duplicate"] == 1 and not ledger.take_refused()


def test_an_id_reused_after_its_group_trained_is_refused_also_after_a_restart():
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S))
    read_all(ledger, copy("g", "a"))
    ledger.take()
    assert len(ledger.trained()) == G
    read_all(ledger, copy("g", "a", [0]) and [rollout("g", 0, "a", rid="new")], start=G)
    assert len(ledger.take_refused()) == 1 and not ledger.complete
    st = ledger.to_checkpoint(1, 1, {0: G + 1})
    assert st.offsets == {0: G + 1} and st.processed == []  # nothing of "g" is re-read ...
    again = Ledger.from_checkpoint(CheckpointState.from_json(json.dumps(asdict(st))), GroupAssembler(G, TIMEOUT_S))
    read_all(again, copy("g", "b"), start=G + 1)  # ... and yet its id is remembered
    assert len(again.take_refused()) == G and not again.complete and again.assembler.num_open == 0


def test_a_late_sample_of_a_timed_out_group_is_timed_out_but_another_copy_is_refused():
    clock = [0.0]
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S, clock=lambda: clock[0]))
    read_all(ledger, copy("g", "a", [0, 1]))
    clock[0] = TIMEOUT_S + 1
    assert [g.group_id for g in ledger.expire()] == ["g"]
    read_all(ledger, [rollout("g", 2, "a"), rollout("g", 3, "b")], start=2)
    assert ledger.counters["timed_out"] == 3 and ledger.counters["dlq"] == 1
    assert [it.rollout.producer_id for it, _ in ledger.take_refused()] == ["b"]


def test_ids_of_held_groups_are_not_checkpointed_as_closed():
    """A complete group waiting for its batch at a checkpoint is re-read after a restart:
    its id must not be closed then, or the group would be refused."""
    ledger = Ledger(GroupAssembler(G, TIMEOUT_S))
    read_all(ledger, copy("g", "a"))
    st = ledger.to_checkpoint(0, 0, {0: G})
    assert st.offsets == {0: 0} and st.closed_groups == []
    again = Ledger.from_checkpoint(CheckpointState.from_json(json.dumps(asdict(st))), GroupAssembler(G, TIMEOUT_S))
    read_all(again, copy("g", "a"))
    assert [g.group_id for g in again.complete] == ["g"] and not again.take_refused()


def test_the_closed_window_is_bounded():
    a = GroupAssembler(1, TIMEOUT_S, closed_window=3)
    ledger = Ledger(a)
    for i in range(10):
        ledger.read([Item(0, i, Rollout(rollout_id=f"r{i}", group_id=f"g{i}", sample_idx=0, group_size=1,
                                        prompt_ids=np.array([1], np.int32), response_ids=np.array([3], np.int32),
                                        logprobs=np.array([-0.5], np.float32), policy_version=0, reward=0.0))])
        ledger.take()
        ledger.trained()
    assert [gid for gid, _, _ in a.closed_groups()] == ["g7", "g8", "g9"]


# ---------------------------------------------------------------- the property


@dataclass(frozen=True)
class Published:
    rollout: Rollout
    copy: tuple[str, str]  # (group id, producer): the copy it belongs to (consumer/stream/assembler.py)


@st.composite
def streams(draw) -> list[Published]:
    """One partition: copies of a few group ids (each from its own producer, or a second copy
    of the same producer on held slots), some partial, interleaved; publisher retries."""
    n_ids = draw(st.integers(1, 4))
    copies = []
    for _ in range(draw(st.integers(1, 7))):
        gid = f"g{draw(st.integers(0, n_ids - 1))}"
        producer = draw(st.sampled_from(["a", "b", "c"]))
        slots = draw(st.lists(st.integers(0, G - 1), min_size=1, max_size=G, unique=True))\
            if draw(st.booleans()) else list(range(G))
        n = sum(1 for c in copies if c[0] == gid and c[1] == producer)
        copies.append((gid, producer, [rollout(gid, i, producer, rid=f"{producer}/{gid}/{n}/{i}") for i in slots]))
    # interleave: repeatedly take the next record of a drawn copy
    queues = [list(recs) for _, _, recs in copies]
    out: list[Published] = []
    while any(queues):
        i = draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
        r = queues[i].pop(0)
        out.append(Published(r, (r.group_id, r.producer_id)))
        if draw(st.integers(0, 9)) == 0:  # a publisher retry: the same record again
            out.append(Published(r, (r.group_id, r.producer_id)))
    return out


# what the loop does between reads; a restart crashes and resumes from the last checkpoint
ACTIONS = st.lists(st.sampled_from(["read", "read", "read", "tick", "train", "drop", "checkpoint", "restart"]),
                   min_size=1, max_size=60)


class Loop:
    """The service's bookkeeping around a ledger, with outcomes per record position."""

    def __init__(self, stream: list[Published]):
        self.stream, self.t = stream, 0.0
        self.ckpt: CheckpointState | None = None
        self.committed: dict[int, str] = {}   # offset -> outcome, as of the last checkpoint
        self.pending: dict[int, str] = {}     # since then (lost at a restart)
        self.lineage: list[str] = []          # ids of the groups completed (trained or dropped) as of
        self.since: list[str] = []            # the last checkpoint, and since then (lost at a restart)
        self.new_incarnation(None)

    def new_incarnation(self, st: CheckpointState | None) -> None:
        assembler = GroupAssembler(G, TIMEOUT_S, clock=lambda: self.t)
        self.ledger = Ledger(assembler) if st is None else Ledger.from_checkpoint(st, assembler)
        self.pos = 0 if st is None else st.offsets.get(0, 0)

    def outcome(self, offsets, outcome: str) -> None:
        for o in offsets:
            assert o not in self.pending and o not in self.committed, f"offset {o}: two outcomes"
            self.pending[o] = outcome

    def step(self, action: str, n: int) -> None:
        led = self.ledger
        if action == "read" and self.pos < len(self.stream):
            chunk = self.stream[self.pos:self.pos + n]
            led.read([Item(0, self.pos + k, p.rollout) for k, p in enumerate(chunk)])
            self.pos += len(chunk)
            self.outcome([it.offset for it, _ in led.take_refused()], "dlq")
        elif action == "tick":
            self.t += TIMEOUT_S * n / 3
            self.outcome([h.offset for g in led.expire() for h in g.samples.values()], "timed_out")
        elif action == "train":
            while len(led.building) < n and led.take() is not None:
                pass
            self.check_batch(led.building)
            self.since += [g.group_id for g in led.building]
            self.outcome([h.offset for g in led.building for h in g.samples.values()], "trained")
            led.trained()
        elif action == "drop" and (g := led.take()) is not None:
            self.since.append(g.group_id)
            self.outcome([h.offset for h in g.samples.values()], "dropped_stale")
            led.drop(g)
        elif action == "checkpoint":
            self.checkpoint()
        elif action == "restart":
            self.pending, self.since = {}, []
            st = None if self.ckpt is None else CheckpointState.from_json(json.dumps(asdict(self.ckpt)))
            self.new_incarnation(st)

    def check_batch(self, groups) -> None:
        ids = [g.group_id for g in groups]
        assert len(ids) == len(set(ids)), f"two groups under one id in a batch: {ids}"
        for g in groups:
            copies = {self.stream[h.offset].copy for h in g.samples.values()}
            assert len(copies) == 1, f"group {g.group_id} assembled from copies {copies}"
            group_advantages([TrainSample.from_rollout(r) for r in g.rollouts()], G)

    def checkpoint(self) -> None:
        self.ckpt = self.ledger.to_checkpoint(0, 0, {0: self.pos})
        self.committed.update(self.pending)
        self.lineage += self.since
        self.pending, self.since = {}, []
        assert len(self.lineage) == len(set(self.lineage)), f"a group id completed twice: {self.lineage}"

    def balance(self) -> None:
        """Nothing counted twice (the exact balance needs the end: after a restart the
        counters already hold the done records above the offsets, not yet re-read)."""
        c = self.ledger.counters
        assert set(c) == set(OUTCOMES)
        assert sum(c.values()) + self.ledger.held_records() <= len(self.stream)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stream=streams(), actions=ACTIONS, sizes=st.lists(st.integers(1, 5), min_size=60, max_size=60))
def test_any_interleaving_of_copies_timeouts_and_restarts(stream, actions, sizes):
    loop = Loop(stream)
    for action, n in zip(actions, sizes):
        loop.step(action, n)
        loop.balance()
    # the producers stopped: read everything, time the rest out, train what completed
    while loop.pos < len(stream):
        loop.step("read", 5)
        loop.balance()
    loop.step("tick", 4)
    while loop.ledger.complete:
        loop.step("train", 2)
    loop.checkpoint()
    loop.balance()
    assert loop.ledger.held_records() == 0
    c = loop.ledger.counters
    assert sum(c.values()) == len(stream), "a record was lost or counted twice"
    outcomes = list(loop.committed.values())  # by record: each has one (Loop.outcome)
    for outcome in ("trained", "dropped_stale", "dlq"):
        assert outcomes.count(outcome) == c[outcome], outcome
    # the rest are counted by number: a duplicate, or a sample of a group that timed out
    assert c["duplicate"] + c["timed_out"] == len(stream) - len(outcomes) + outcomes.count("timed_out")
