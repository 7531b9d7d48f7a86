"""The producer's admission rule (producer/admission.py), called for real:
every reason, the staleness backpressure estimate (scaled by the trainer's
filtered share under dynamic sampling) and the soak's held-group stall."""
from __future__ import annotations

import dataclasses

import pytest

from rlstream.common.control.messages import TrainerProgress
from rlstream.producer.admission import (
    MAX_FILTERED_SHARE,
    AdmissionView,
    admission_block,
    queued_groups,
    steps_ahead,
)

G, B = 4, 2


def view(**changes) -> AdmissionView:
    """An idle producer at version 0 in front of a trainer at version 0 that read everything."""
    base = AdmissionView(
        paused=False, pending_samples=0, groups_in_flight=0, max_groups_in_flight=8,
        progress=TrainerProgress(trainer_version=0, read_offsets={0: 100}, held_records=0,
                                 groups_per_batch=B, group_size=G),
        engine_version=0, max_staleness=2, end_offsets=lambda: {0: 100}, own_unacked_records=0, group_size=G)
    return dataclasses.replace(base, **changes)


def progress(**fields) -> TrainerProgress:
    return TrainerProgress(**{"trainer_version": 0, "groups_per_batch": B, "group_size": G, **fields})


def test_counts_unread_held_and_own_records():
    ends = {0: 100, 1: 60}
    # 20 + 8 unread, 4 held by the trainer, 3 of ours unacknowledged: 35 records -> 8 groups
    assert queued_groups(ends, {0: 80, 1: 52}, 4, 3, 0, G) == 8
    # plus our 2 groups still generating
    assert queued_groups(ends, {0: 80, 1: 52}, 4, 3, 2, G) == 10
    # a partition the trainer has not read yet counts from 0; reads past a stale end count 0
    assert queued_groups({0: 8, 1: 4}, {0: 12}, 0, 0, 0, G) == 1


def test_an_idle_pipeline_admits():
    assert admission_block(view()) is None


@pytest.mark.parametrize("changes,reason", [
    ({"paused": True}, "paused"),
    ({"pending_samples": 1}, "publish_buffer"),
    ({"groups_in_flight": 8}, "in_flight"),
    ({"groups_in_flight": 9}, "in_flight"),
    # 3 queued groups ahead at B = 2: trained at V + 1, v = 0 -> staleness 1 <= 1 admits ...
    ({"end_offsets": lambda: {0: 112}, "max_staleness": 1}, None),
    # ... 4 queued: V + 2 - v = 2 > 1 refuses
    ({"end_offsets": lambda: {0: 116}, "max_staleness": 1}, "staleness"),
])
def test_each_reason(changes, reason):
    assert admission_block(view(**changes)) == reason


def test_reasons_are_checked_in_order_and_the_broker_only_when_needed():
    asked = []

    def ends():
        asked.append(1)
        return {0: 10_000}  # far behind: staleness would refuse

    everything = dict(paused=True, pending_samples=1, groups_in_flight=8, end_offsets=ends)
    assert admission_block(view(**everything)) == "paused"
    assert admission_block(view(**{**everything, "paused": False})) == "publish_buffer"
    assert admission_block(view(**{**everything, "paused": False, "pending_samples": 0})) == "in_flight"
    assert asked == [], "the end offsets were queried although a cheap reason already refused"
    assert admission_block(view(end_offsets=ends)) == "staleness" and asked == [1]


def test_staleness_rule_uses_every_input():
    """Admit iff V + floor(Q / B) - v <= max_staleness, Q = queued_groups(...)."""
    # Q = (8 unread + 4 held + 4 own unacked) / G + 2 in flight = 6; B = 2 -> trained at V + 3
    v = view(end_offsets=lambda: {0: 108}, progress=progress(trainer_version=5, read_offsets={0: 100},
                                                             held_records=4),
             own_unacked_records=4, groups_in_flight=2, engine_version=5, max_staleness=3)
    assert admission_block(v) is None
    assert admission_block(dataclasses.replace(v, max_staleness=2)) == "staleness"
    # this producer one version behind the trainer: one more version of staleness
    assert admission_block(dataclasses.replace(v, engine_version=4)) == "staleness"
    # a bigger batch drains the queue faster: B = 6 -> trained at V + 1
    assert admission_block(dataclasses.replace(v, max_staleness=1,
                                               progress=progress(trainer_version=5, read_offsets={0: 100},
                                                                 held_records=4, groups_per_batch=6))) is None
    # max_staleness 0 is synchronous: nothing queued ahead, or wait
    assert admission_block(view(max_staleness=0)) is None
    assert admission_block(view(max_staleness=0, groups_in_flight=B)) == "staleness"
    assert admission_block(view(max_staleness=0, groups_in_flight=B - 1)) is None


def test_before_any_trainer_progress_the_cautious_default_holds_at_max_staleness():
    """The service starts from TrainerProgress(version 0, B = 1, nothing read): it
    admits max_staleness + 1 groups, then waits for the trainer."""
    start = view(progress=TrainerProgress(trainer_version=0, groups_per_batch=1, group_size=G),
                 end_offsets=lambda: {0: 0}, max_staleness=2)
    assert [admission_block(dataclasses.replace(start, groups_in_flight=n)) for n in range(4)] ==\
        [None, None, None, "staleness"]


def test_one_held_group_does_not_pin_the_queue():
    """The soak's stall: the trainer holds one gated group (offsets 0..3 of
    partition 0) while waiting for a second; every record behind it was read
    and dropped as stale. Counting from the checkpointed (held-pinned) offset
    saw 100 queued records = 25 groups and refused every new group, so the
    trainer waited for data nobody would produce. Counting what it has not
    read plus what it holds sees one group and admits."""
    at_884 = dict(engine_version=884, max_staleness=2, end_offsets=lambda: {0: 100})
    pinned = view(progress=progress(trainer_version=884, read_offsets={0: 0}, held_records=0), **at_884)
    assert queued_groups({0: 100}, {0: 0}, 0, 0, 0, G) == 25
    assert admission_block(pinned) == "staleness"
    actual = view(progress=progress(trainer_version=884, read_offsets={0: 100}, held_records=G), **at_884)
    assert queued_groups({0: 100}, {0: 100}, G, 0, 0, G) == 1
    assert admission_block(actual) is None


def test_steps_ahead_scales_the_queue_by_the_filtered_share():
    assert [steps_ahead(q, 2) for q in (0, 1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2, 2]  # floor(Q / B)
    assert steps_ahead(8, 2, 0.5) == 2  # half the queue is filtered: a step takes B / (1 - f) = 4 groups
    assert steps_ahead(10, 1, 0.9) == 1  # not 0: 10 * (1 - 0.9) is 0.999... in floats
    assert steps_ahead(100, 1, 1.0) == steps_ahead(100, 1, MAX_FILTERED_SHARE) == 10  # capped
    assert steps_ahead(8, 2, -0.1) == 4


def test_a_filtered_share_admits_more_so_filtering_does_not_starve_the_trainer():
    # 4 groups queued at B = 2, max_staleness 1: trained at V + 2 -> refused without filtering ...
    v = view(end_offsets=lambda: {0: 116}, max_staleness=1)
    assert admission_block(v) == "staleness"
    # ... but with half of the trainer's groups filtered it takes 4 per step: trained at V + 1
    half = dataclasses.replace(v, progress=progress(read_offsets={0: 100}, filtered_share=0.5))
    assert admission_block(half) is None
    # the cap: even an all-filtered trainer (share 1.0) bounds the queue at 10x
    far = dataclasses.replace(v, end_offsets=lambda: {0: 100 + 4 * 40},
                              progress=progress(read_offsets={0: 100}, filtered_share=1.0))
    assert admission_block(far) == "staleness"
