"""The producer's estimate of the groups queued ahead of a new one (staleness
backpressure, producer/service.py `queued_groups`)."""
from __future__ import annotations

from producer.service import queued_groups

G, B = 4, 2


def admits(trainer_v: int, own_v: int, queued: int, max_staleness: int) -> bool:
    """The producer's admission rule: V + floor(Q / B) - v <= max_staleness."""
    return trainer_v + queued // B - own_v <= max_staleness


def test_counts_unread_held_and_own_records():
    ends = {0: 100, 1: 60}
    # 20 + 8 unread, 4 held by the trainer, 3 of ours unacknowledged: 35 records -> 8 groups
    assert queued_groups(ends, {0: 80, 1: 52}, 4, 3, 0, G) == 8
    # plus our 2 groups still generating
    assert queued_groups(ends, {0: 80, 1: 52}, 4, 3, 2, G) == 10
    # a partition the trainer has not read yet counts from 0; reads past a stale end count 0
    assert queued_groups({0: 8, 1: 4}, {0: 12}, 0, 0, 0, G) == 1


def test_one_held_group_does_not_pin_the_queue():
    """The soak's stall: the trainer holds one gated group (offsets 0..3 of
    partition 0) while waiting for a second; every record behind it was read
    and dropped as stale. Counting from the checkpointed (held-pinned) offset
    saw 100 queued records = 25 groups and refused every new group, so the
    trainer waited for data nobody would produce. Counting what it has not
    read plus what it holds sees one group and admits."""
    ends, consumed, read = {0: 100}, {0: 0}, {0: 100}
    pinned = queued_groups(ends, consumed, 0, 0, 0, G)
    assert pinned == 25 and not admits(884, 884, pinned, max_staleness=2)
    actual = queued_groups(ends, read, G, 0, 0, G)
    assert actual == 1 and admits(884, 884, actual, max_staleness=2)
