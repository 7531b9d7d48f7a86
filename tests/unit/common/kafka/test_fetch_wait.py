"""common/kafka/fetch_wait.py: when a consumer's fetch wait rises (the rule, on a stand-in consumer)."""
from __future__ import annotations

from collections import namedtuple

from rlstream.common.kafka.fetch_wait import FetchWait

TP = namedtuple("TP", "topic partition")


class Consumer:
    def __init__(self, highwater: dict):
        self.hw = highwater

    def highwater(self, tp):
        return self.hw.get(tp)


def test_the_wait_doubles_only_on_an_empty_poll_while_a_partition_is_behind_and_stops_at_the_cap():
    a, b = TP("r", 0), TP("r", 1)
    w = FetchWait("test", 20, cap_ms=100)
    at = {a: 10, b: 5}
    assert w.starved(Consumer({a: 10, b: 5}), {}, at) == []  # at the end: an empty poll is idle
    assert w.starved(Consumer({}), {}, at) == []  # no fetch answered yet: nothing known
    assert w.starved(Consumer({a: 12, b: 5}), {b: ["record"]}, at) == []  # records came: fetches work
    assert w.starved(Consumer({a: 12, b: 5}), {}, at) == [a]  # behind, and the fetch brought nothing
    assert [w.raise_for([a], at) for _ in range(4)] == [True, True, True, False]
    assert (w.ms, w.raised, w.at_cap) == (100, 3, True)  # 20 -> 40 -> 80 -> 100 (the cap)
    assert not FetchWait("test", 20).raise_for([], at)
    assert FetchWait("test", 20, cap_ms=60_000, request_timeout_ms=30_000).cap_ms == 15_000  # below the timeout
