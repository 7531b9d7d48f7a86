"""ops/harness/experiments.py: which arms run (the `experiment` settings)."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlstream.common.config import load_config
from rlstream.common.errors import ConfigError
from rlstream.harness.experiments import selected_arms

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny-cpu.yaml"


def test_every_arm_by_default_or_the_named_ones():
    cfg = load_config(CONFIG, environ={})
    assert [a.name for a in selected_arms("objectives", cfg)] == ["minirl", "minirl_no_is", "grpo", "cispo",
                                                                   "dppo_tv", "dppo_kl"]
    cfg = load_config(CONFIG, environ={"RLSTREAM__EXPERIMENT__ARMS": "grpo,cispo",
                                       "RLSTREAM__EXPERIMENT__ARM_SECONDS": "30"})
    assert [a.name for a in selected_arms("objectives", cfg)] == ["grpo", "cispo"]
    assert cfg.experiment.arm_seconds == 30.0 and cfg.experiment.reps is None


def test_arms_naming_no_arm_is_a_config_error():
    cfg = load_config(CONFIG, ["experiment.arms=[nope]"], environ={})
    with pytest.raises(ConfigError, match="experiment.arms: nope names no arm of 'replay'"):
        selected_arms("replay", cfg)


def test_dynamic_sampling_arms_differ_only_in_the_setting():
    cfg = load_config(CONFIG, environ={})
    arms = selected_arms("dynamic_sampling", cfg)
    assert [(a.name, a.overrides) for a in arms] == [("with", {"consumer.dynamic_sampling": "on"}),
                                                     ("without", {"consumer.dynamic_sampling": "off"})]


def test_samples_to_target_read_the_progress_rows():
    from rlstream.harness.arms import samples_to

    rows = [{"kind": "eval", "time": 0.0}]
    rows += [{"kind": "tick", "time": 5.0 * i, "generated": 100, "outcomes": {"trained": 64 * i}} for i in range(1, 7)]
    assert samples_to(rows, 15.0) == (192, 300)
    assert samples_to(rows, 17.5) == (192, 300)  # the last row at or before the target
    assert samples_to(rows, None) == (None, None) and samples_to(rows, 1.0) == (0, 0)


def test_dynamic_sampling_summary_is_seconds_to_target_without_over_with():
    from rlstream.harness.experiments import SUMMARIES

    def arm(s, t, rl=500.0):
        return {"seconds_to_target": s, "trained_to_target": t, "generated_to_target": t and 2 * t, "rl_seconds": rl}

    results = {"with": arm(100.0, 800), "without": arm(150.0, 1600)}
    runs = {"with": [arm(90.0, 1), arm(110.0, 1)], "without": [arm(180.0, 1), arm(120.0, 1)]}
    out = SUMMARIES["dynamic_sampling"](results, runs, 2)
    assert out["dynamic_sampling_speedup"] == 1.5 and out["trained_to_target_ratio"] == 2.0
    assert out["dynamic_sampling_speedup_each"] == [2.0, round(120 / 110, 3)]
    assert out["dynamic_sampling_speedup_each_at_least"] == out["dynamic_sampling_speedup_each"]
    assert out["dynamic_sampling_speedup_at_least"] == 1.5
    assert out["with_seconds_to_target"] == 100.0 and out["without_generated_to_target"] == 3200
    # a run without that missed the target (stopped at 480 s): no speedup, a lower bound
    runs["without"][0] = arm(None, None, rl=480.0)
    results["without"]["seconds_to_target"] = None
    out = SUMMARIES["dynamic_sampling"](results, runs, 2)
    assert out["dynamic_sampling_speedup"] is None and out["dynamic_sampling_speedup_each"][0] is None
    assert out["dynamic_sampling_speedup_each_at_least"] == [round(480 / 90, 3), round(120 / 110, 3)]
    assert out["dynamic_sampling_speedup_at_least"] == 3.0  # mean(480, 120) / mean(90, 110)
    # a run with that missed it: nothing is claimed
    runs["with"][1] = arm(None, None)
    results["with"]["seconds_to_target"] = None
    out = SUMMARIES["dynamic_sampling"](results, runs, 1)
    assert out["dynamic_sampling_speedup"] is None and "dynamic_sampling_speedup_at_least" not in out
