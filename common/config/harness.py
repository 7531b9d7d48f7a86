"""The tooling's sections, `demo` and `experiment` (ops/harness/): they are part of
the schema because one deployment file holds every section."""
from __future__ import annotations

from pydantic import Field, field_validator

from rlstream.common.config.base import _Section


class DemoSettings(_Section):
    """`rlstream demo` and the runs it shares with the experiments (ops/harness/)."""

    work_dir: str = "runs/demo"
    """Warm start, and one run directory per run under `runs/` (never reused)."""
    num_producers: int = Field(1, ge=1, le=8)
    target_gain: float = Field(0.15, ge=0)
    """Stop once held-out accuracy rose this much above the warm start."""
    max_minutes: float = Field(15.0, gt=0)
    """Time budget of the RL phase (the demo stops when the target is reached)."""
    reuse_warm_start: bool = True
    """Reuse an SFT warm start built from the same base model and task."""
    sft_band_low: float = Field(0.15, ge=0, le=1)
    """SFT stops once greedy held-out accuracy is inside [low, high] ("a minority")."""
    sft_band_high: float = Field(0.45, ge=0, le=1)
    sft_max_steps: int = Field(4000, ge=1)
    eval_metric: str = Field("avg@8", pattern=r"^(greedy|avg@\d+|pass@\d+)$")
    """Held-out accuracy: greedy, avg@k (mean over k samples, the paper's) or pass@k."""
    eval_every_s: float = Field(15.0, gt=0)
    """Seconds between held-out evaluations of the newest weight version."""
    progress_every_s: float = Field(5.0, gt=0)
    """Seconds between progress lines (one scrape of every service)."""
    sft_tool_traces: float = Field(0.5, ge=0, le=1)
    """With `producer.episodes`: a second SFT stage on the warm start teaches the tool's call
    format; this share of its examples are worked tool episodes, the rest plain answers."""
    sft_tool_band_low: float = Field(0.2, ge=0, le=1)
    """That stage stops once greedy held-out accuracy WITH the tool is inside [low, high]
    (the format known, not perfect: RL must have room to improve)."""
    sft_tool_band_high: float = Field(0.5, ge=0, le=1)
    sft_tool_max_steps: int = Field(1000, ge=1)


class ExperimentSettings(_Section):
    """`rlstream experiment NAME` (ops/harness/experiments.py). Environment:
    `RLSTREAM__EXPERIMENT__ARMS=sync,async_k2`, `RLSTREAM__EXPERIMENT__ARM_SECONDS=60`,
    `RLSTREAM__EXPERIMENT__REPS=1`."""

    arms: list[str] = []
    """Run only these arms (e.g. to redo some of them); empty: every arm. A
    comma-separated string is accepted."""
    arm_seconds: float | None = Field(None, gt=0)
    """RL seconds per arm; None: the experiment's own (async 240, objectives 90, replay 60,
    dynamic_sampling 480, tool_use 300, stability 300 as a cap on its 120 versions)."""
    reps: int | None = Field(None, ge=1)
    """Repetitions per arm, interleaved A B B A; None: the experiment's own (async 2, others 1)."""
    arm_versions: int | None = Field(None, ge=1)
    """Stop each arm after this many policy versions (arm_seconds still caps it); None: the
    experiment's own (stability 120; the others run their seconds or to the target)."""

    @field_validator("arms", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        return [a.strip() for a in v.split(",") if a.strip()] if isinstance(v, str) else v
