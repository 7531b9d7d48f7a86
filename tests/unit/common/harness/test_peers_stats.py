"""tests/bench/_peers_stats.py: the figures of the TRL comparison bench from held-out timelines."""
from tests.bench._peers_stats import accuracy_at, summarize, time_to_target


def tl(*pts):
    return [{"time": t, "heldout_accuracy": a} for t, a in pts]


def test_time_to_target_needs_two_evaluations_in_a_row():
    assert time_to_target(tl((0, 0.1), (10, 0.3), (20, 0.2), (30, 0.3), (40, 0.31)), 0.3) == 40
    assert time_to_target(tl((0, 0.1), (10, 0.3), (20, 0.2)), 0.3) is None
    assert time_to_target(tl((0, 0.1), (10, 0.3)), 0.3, confirmations=1) == 10


def test_accuracy_at_takes_the_newest_evaluation_not_after_t():
    t = tl((0, 0.1), (10, 0.2), (20, 0.4))
    assert accuracy_at(t, 15) == 0.2
    assert accuracy_at(t, 20) == 0.4
    assert accuracy_at(t, -1) is None


def test_summarize_ratios_and_equal_time():
    rl = [{"evals": tl((0, 0.1), (10, 0.3), (20, 0.35), (60, 0.4)), "samples_per_s": 400.0}] * 3
    trl = [{"evals": tl((0, 0.1), (30, 0.3), (40, 0.3), (50, 0.2)), "samples_per_s": 100.0}] * 3
    s = summarize(rl, trl, 0.3)
    assert s["time_to_target_over_trl"] == 0.5  # 20 s / 40 s
    assert s["samples_per_s_over_trl"] == 4.0
    assert s["equal_time_s"] == 50  # the shortest timeline's end
    assert s["heldout_at_equal_time"] == {"rlstream": 0.35, "trl": 0.2}


def test_summarize_has_no_time_ratio_when_a_trl_run_missed_the_target():
    rl = [{"evals": tl((0, 0.1), (10, 0.3), (20, 0.3), (40, 0.3)), "samples_per_s": 1.0}]
    trl = [{"evals": tl((0, 0.1), (30, 0.3), (40, 0.3)), "samples_per_s": 1.0},
           {"evals": tl((0, 0.1), (30, 0.2), (40, 0.2)), "samples_per_s": 1.0}]
    s = summarize(rl, trl, 0.3)
    assert s["time_to_target_over_trl"] is None
    assert s["seconds_to_target"]["trl"] == [40, None]
    assert s["heldout_at_equal_time"]["trl"] == 0.25
