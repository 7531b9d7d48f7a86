"""Group assembly, dedup, timeouts, pending offsets; the staleness gate and dynamic sampling."""
import numpy as np
import pytest

from rlstream.common.config import ControlSettings
from rlstream.common.record import Rollout
from rlstream.consumer.stream.assembler import GroupAssembler
from rlstream.consumer.stream.gate import (
    FilteredShare,
    GateDecision,
    gate_group,
    sample_staleness,
    zero_variance,
)
from tests.support.fakes import Clock


def roll(group="g", idx=0, G=2, version=0, rid=None, tv=None, reward=1.0):
    return Rollout(rollout_id=rid or f"{group}-{idx}", group_id=group, sample_idx=idx, group_size=G,
                   prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3], np.int32),
                   logprobs=np.array([-0.5], np.float32), policy_version=version, reward=reward,
                   token_versions=tv)


def test_group_completes_and_dedups():
    a = GroupAssembler(group_size=2, timeout_s=10)
    assert a.add(roll(idx=0), 0, 5).outcome == "held"
    assert a.add(roll(idx=0), 0, 6).outcome == "duplicate"  # same rollout_id
    assert a.add(roll(idx=0, rid="other"), 0, 7).outcome == "reused"  # same slot, another record: a second copy
    res = a.add(roll(idx=1), 0, 8)
    assert res.outcome == "completed" and [r.sample_idx for r in res.group.rollouts()] == [0, 1]
    assert a.num_open == 0


def test_another_group_size_never_reaches_a_group():
    """The reader refuses such records (DLQ, field group_size: consumer/stream/intake.py); one that slips
    through is a bug, raised, not held in a group that can never complete."""
    from rlstream.common.errors import InvalidSampleError

    a = GroupAssembler(group_size=4, timeout_s=10)
    with pytest.raises(InvalidSampleError, match="group_size 2"):
        a.add(roll(G=2), 0, 0)
    assert a.num_open == 0


def test_timeout_and_pending_offsets():
    clock = Clock()
    a = GroupAssembler(group_size=3, timeout_s=5, clock=clock)
    a.add(roll("a", 0, G=3), 0, 10)
    a.add(roll("b", 0, G=3), 1, 3)
    clock.t = 2
    a.add(roll("a", 1, G=3), 0, 12)
    assert a.pending_min_offsets() == {0: 10, 1: 3}
    clock.t = 6
    expired = a.expire()
    assert sorted(g.group_id for g in expired) == ["a", "b"]
    assert a.pending_min_offsets() == {} and a.num_open == 0


def test_mark_seen_skips_reread():
    a = GroupAssembler(group_size=2, timeout_s=5)
    a.mark_seen(["g-0"])
    assert a.add(roll(idx=0), 0, 0).outcome == "duplicate"


def test_staleness_uses_oldest_token_version():
    r = roll(version=3, tv=np.array([[3, 1]], np.int64))
    assert sample_staleness(r, 5) == 2
    assert sample_staleness(roll(version=7), 5) == 0  # newer than trainer


@pytest.mark.parametrize("max_s,trainer_v,keep", [(2, 5, True), (1, 5, False), (0, 3, True), (0, 4, False)])
def test_drop_mode_bound(max_s, trainer_v, keep):
    group = [roll(idx=0, version=3), roll(idx=1, version=3)]
    d = gate_group(group, trainer_v, ControlSettings(max_staleness=max_s, mode="drop"))
    assert d.keep is keep
    assert d.weights == ((1.0, 1.0) if keep else ())
    assert d.outcome == (None if keep else "dropped_stale")


def test_reweight_mode_follows_decay_formula():
    group = [roll(idx=0, version=3), roll(idx=1, version=1)]
    d = gate_group(group, 4, ControlSettings(max_staleness=3, mode="reweight", decay=0.5))
    assert d.keep and d.staleness == 3
    assert d.weights == (0.5 ** 1, 0.5 ** 3)
    assert d.ages == (1, 3)  # each sample's own age: the trainer splits its signals by it
    assert gate_group(group, 4, ControlSettings(max_staleness=3)).ages == (1, 3)
    assert not gate_group(group, 5, ControlSettings(max_staleness=3, mode="reweight", decay=0.5)).keep


@pytest.mark.parametrize("rewards,zero", [((1.0, 1.0), True), ((0.0, 0.0, 0.0), True), ((0.5, 0.5), True),
                                           ((0.0, 1.0), False), ((1.0, 1.0, 0.5), False), ((0.0,), True)])
def test_zero_variance_is_all_rewards_equal(rewards, zero):
    assert zero_variance([roll(idx=i, reward=r) for i, r in enumerate(rewards)]) is zero


@pytest.mark.parametrize("mode", ["drop", "reweight"])
def test_dynamic_sampling_filters_equal_rewards_after_the_staleness_bound(mode):
    state = ControlSettings(max_staleness=1, mode=mode, decay=0.5)
    same = [roll(idx=0, version=3, reward=0.0), roll(idx=1, version=3, reward=0.0)]
    mixed = [roll(idx=0, version=3, reward=0.0), roll(idx=1, version=3, reward=1.0)]
    assert gate_group(same, 4, state, filter_zero_variance=True) == GateDecision(False, 1, (), "filtered")
    kept = gate_group(mixed, 4, state, filter_zero_variance=True)
    assert kept.keep and kept.outcome is None and kept.weights == ((0.5, 0.5) if mode == "reweight" else (1.0, 1.0))
    # off: the same group is kept, as before dynamic sampling
    assert gate_group(same, 4, state).keep and gate_group(same, 4, state, filter_zero_variance=False).keep
    # a stale group is dropped as stale, whatever its rewards
    assert gate_group(same, 5, state, filter_zero_variance=True).outcome == "dropped_stale"


def test_filtered_share_over_a_window_of_groups_within_the_bound():
    share = FilteredShare(window=4)
    assert share.value == 0.0
    kept, filtered, stale = GateDecision(True, 0, (1.0,)), GateDecision(False, 0, (), "filtered"),\
        GateDecision(False, 9, (), "dropped_stale")
    for d in (filtered, kept, stale, stale):
        share.note(d)
    assert share.value == 0.5  # stale groups are not counted
    for d in (filtered, filtered, filtered):
        share.note(d)
    assert share.value == 0.75  # the window holds the last 4: kept, filtered x 3
    for d in (filtered,) * 4:
        share.note(d)
    assert share.value == 1.0


def test_dedup_window_is_bounded():
    a = GroupAssembler(group_size=1, timeout_s=5, dedup_window=3)
    for i in range(5):
        assert a.add(roll(group=f"g{i}", G=1, rid=f"r{i}"), 0, i).outcome == "completed"
    assert a.add(roll(group="g4", G=1, rid="r4"), 0, 9).outcome == "duplicate"
    # evicted from the dedup window, yet its group id is still closed: refused, never completed twice
    assert a.add(roll(group="g0", G=1, rid="r0"), 0, 9).outcome == "reused"


def test_staleness_of_a_multi_turn_record_is_its_oldest_model_tokens():
    """Environment tokens carry the version they were appended at but were never sampled."""
    r = Rollout(rollout_id="m", group_id="g", sample_idx=0, group_size=1,
                prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3, 4, 5, 6], np.int32),
                logprobs=np.array([-0.5, 0, 0, -0.5], np.float32), policy_version=4, reward=1.0,
                loss_mask=np.array([1, 0, 0, 1], bool),
                token_versions=np.array([[4, 1], [2, 2], [5, 1]], np.int64))
    assert sample_staleness(r, 6) == 2  # model tokens at 4 and 5; env tokens' 2 does not count
    d = gate_group([r], 6, ControlSettings(max_staleness=2, mode="drop"))
    assert d.keep and d.staleness == 2
