"""Record accounting (ops/harness/census.py): published == every outcome + held."""
from __future__ import annotations

from rlstream.harness.census import TopicCensus, account


def test_account_balances_with_whole_held_groups():
    outcomes = dict(trained=640, dropped_stale=16, timed_out=8, dlq=1)
    a = account(TopicCensus(681, 681, 681), outcomes, None, group_size=8, groups_per_batch=4)
    assert a["held"] == 16 and a["ok"], a


def test_account_fails_on_lost_or_partial_records():
    outcomes = dict(trained=640)
    assert not account(TopicCensus(650, 650, 650), outcomes, None, 8, 4)["ok"]   # 10: not whole groups
    assert not account(TopicCensus(680, 680, 680), outcomes, None, 8, 4)["ok"]   # 40 >= B*G = 32
    assert not account(TopicCensus(630, 630, 630), outcomes, None, 8, 4)["ok"]   # counted more than published
    assert not account(None, outcomes, None, 8, 4)["ok"]
    assert not account(TopicCensus(640, 640, 640), None, None, 8, 4)["ok"]      # consumer counters unknown


def test_account_exact_with_the_consumers_held_count():
    outcomes = dict(trained=640)
    assert account(TopicCensus(648, 648, 648), outcomes, 8, 8, 4)["ok"]
    assert not account(TopicCensus(656, 656, 656), outcomes, 8, 8, 4)["ok"]


def test_filtered_groups_are_an_outcome_of_their_own():
    outcomes = dict(trained=640, filtered=96, dropped_stale=8)
    a = account(TopicCensus(752, 752, 752), outcomes, 8, 8, 4)
    assert a["ok"] and a["filtered"] == 96, a
    assert not account(TopicCensus(752, 752, 752), dict(trained=640, dropped_stale=8), 8, 8, 4)["ok"]


def test_the_census_names_what_scored_the_records():
    from rlstream.harness.census import _scorer

    assert _scorer({"reward_info": {"verifier": "reasoning_gym", "dataset": "chain_sum", "score": 0.5}})\
        == "reasoning_gym:chain_sum"
    assert _scorer({"reward_info": {"verifier": "exact_match"}}) == "exact_match"
    assert _scorer({"reward": 1.0}) == "?" and _scorer([1]) == "?"
    a = account(TopicCensus(8, 8, 8, {"exact_match": 8}, 0), dict(trained=8), 0, 8, 4)
    assert a["ok"] and a["scored_by"] == {"exact_match": 8} and a["partial_rewards"] == 0
