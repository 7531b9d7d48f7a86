"""common/harness/experiments.py: which arms run (the `experiment` settings)."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from common.errors import ConfigError
from common.harness.experiments import selected_arms

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny-cpu.yaml"


def test_every_arm_by_default_or_the_named_ones():
    cfg = load_config(CONFIG, environ={})
    assert [a.name for a in selected_arms("objectives", cfg)] == ["minirl", "minirl_no_is", "grpo", "cispo"]
    cfg = load_config(CONFIG, environ={"RLSTREAM__EXPERIMENT__ARMS": "grpo,cispo",
                                       "RLSTREAM__EXPERIMENT__ARM_SECONDS": "30"})
    assert [a.name for a in selected_arms("objectives", cfg)] == ["grpo", "cispo"]
    assert cfg.experiment.arm_seconds == 30.0 and cfg.experiment.reps is None


def test_arms_naming_no_arm_is_a_config_error():
    cfg = load_config(CONFIG, ["experiment.arms=[nope]"], environ={})
    with pytest.raises(ConfigError, match="experiment.arms: nope names no arm of 'replay'"):
        selected_arms("replay", cfg)
