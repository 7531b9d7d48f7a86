"""Stale eviction's pure parts (producer/eviction.py): the producer evicts exactly the
groups the consumer's gate would drop, checked against the gate itself, and only
re-checks when the bound moved towards eviction."""
from __future__ import annotations

import itertools

import numpy as np

from rlstream.common.config import ControlSettings
from rlstream.common.record import Rollout
from rlstream.consumer.stream.gate import gate_group
from rlstream.producer.eviction import StaleEviction, stale_groups
from rlstream.producer.groups import GroupInfo, InFlightGroups
from rlstream.common.tasks.task import Task


def sample(idx: int, token_versions: list[tuple[int, int]]) -> Rollout:
    n = sum(c for _, c in token_versions)
    return Rollout(rollout_id=f"r{idx}", group_id="g", sample_idx=idx, group_size=2,
                   prompt_ids=np.array([1, 2], np.int32), response_ids=np.arange(n, dtype=np.int32),
                   logprobs=np.zeros(n, np.float32), policy_version=token_versions[-1][0], reward=float(idx),
                   token_versions=np.asarray(token_versions, np.int32))


def test_evicts_exactly_what_the_consumer_gate_drops():
    """For every trainer version, bound and pair of samples (their first tokens at versions a and b,
    later tokens one version newer), eviction on the oldest in-flight version agrees with the gate."""
    for V, bound, a, b in itertools.product(range(6), range(4), range(4), range(4)):
        group = [sample(0, [(a, 3), (a + 1, 2)]), sample(1, [(b, 4)])]
        dropped = gate_group(group, V, ControlSettings(max_staleness=bound)).outcome == "dropped_stale"
        evicted = stale_groups({"g": min(a, b)}, V, bound) == ["g"]
        assert evicted == dropped, (V, bound, a, b)


def test_stale_groups_picks_only_the_stale_ones():
    assert stale_groups({"old": 1, "edge": 3, "new": 5, "future": 9}, trainer_version=5, max_staleness=2) == ["old"]
    assert stale_groups({"old": 1}, trainer_version=5, max_staleness=4) == []


def test_due_only_when_the_bound_moves_towards_eviction():
    e = StaleEviction()
    assert e.due(trainer_version=3, max_staleness=4)  # first look
    assert not e.due(3, 4)
    assert not e.due(3, 6)  # a looser bound evicts nothing new
    assert e.due(3, 2)  # an operator lowered it
    assert not e.due(3, 2)
    assert e.due(4, 2)  # the trainer moved on
    assert not e.due(4, 2)


def test_dropping_a_group_frees_its_slot():
    groups = InFlightGroups("p")
    a, b = groups.new_id(), groups.new_id()
    groups.add(a, GroupInfo(Task("x", "1", None), 2))
    groups.add(b, GroupInfo(Task("y", "2", None), 2))
    groups.finish_sample(a)  # one sample of `a` was published before the eviction
    groups.drop(a)
    groups.drop(a)  # already gone: nothing happens
    assert len(groups) == 1 and groups.finish_sample(b).remaining == 1
