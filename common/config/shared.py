"""The sections both services read (`model`, `staleness`, `cli`), the runtime
settings the control plane changes (`ControlSettings`), and the HTTP and liveness
settings each service section holds (with the role variants of liveness)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlstream.common.config.base import _Section


class ModelSettings(_Section):
    path: str = "runs/tiny-model"
    """HF-format model directory (config.json, safetensors, tokenizer)."""
    build_tiny: bool = True
    """Build the tiny Qwen3-MoE at `path` if it does not exist (no downloads)."""


class ControlSettings(_Section):
    """The runtime-tunable settings, declared once: the `staleness` section sets
    their start values, and the control plane (common/control/: `rlstream ctl
    set`, the admin API, the compacted control topic) changes them while the
    services run, validated by this same model."""

    max_staleness: int = Field(2, ge=0, le=1000)
    """Samples older than this many versions are dropped (and counted). In the config file
    `auto` (with `staleness.auto`): the consumer's controller sets it (docs/stability.md)."""
    mode: Literal["drop", "reweight"] = "drop"
    """drop: discard beyond max_staleness. reweight: also scale by decay**staleness."""
    decay: float = Field(1.0, gt=0.0, le=1.0)
    """Per-version sample weight gamma in reweight mode (1.0 = no decay)."""
    paused: bool = False
    """Pause the pipeline: producers admit no new groups, the trainer takes no new batch."""
    max_staleness_auto: bool = False
    """The consumer's controller owns `max_staleness` (consumer/stability/): it moves the bound
    within `staleness.auto`'s limits. An operator's `ctl set max_staleness N` turns this off
    (the operator's bound holds), `ctl set max_staleness auto` turns it back on."""

    @classmethod
    def from_settings(cls, s: "ControlSettings") -> "ControlSettings":
        """A service's own, mutable copy of the runtime settings in `s` (e.g. `cfg.staleness`)."""
        return cls(**{k: getattr(s, k) for k in cls.model_fields})


class AutoStalenessSettings(_Section):
    """`max_staleness: auto` (consumer/stability/controller.py, docs/stability.md): the limits
    an operator sets and the signal thresholds. The controller judges the mean of the steps
    since its last change, once there are `window` of them; it halves the bound when the
    signals degrade and raises it when they are healthy and the trainer waited for data
    (doubling until its first tightening, then by one). The band between each pair of
    thresholds is its hysteresis."""

    min: int = Field(0, ge=0, le=1000)
    """The tightest bound the controller sets (an alert fires while it sits there)."""
    max: int = Field(8, ge=0, le=1000)
    """The loosest bound the controller sets."""
    start: int = Field(2, ge=0, le=1000)
    """The bound `max_staleness: auto` starts at (the control topic's value wins on a restart)."""
    window: int = Field(4, ge=1, le=1000)
    """Steps averaged per decision; after a change, a fresh window under the new bound."""
    ess_tighten: float = Field(0.6, gt=0, le=1)
    """Tighten when the normalised ESS of the token IS weights falls below this."""
    ess_loosen: float = Field(0.8, gt=0, le=1)
    """Loosen only while it is at least this."""
    kl_tighten: float = Field(0.05, gt=0)
    """Tighten when the sampler-vs-trainer KL E[log mu_old - log pi_old] (all records) exceeds this."""
    kl_loosen: float = Field(0.02, gt=0)
    """Loosen only while it is at most this."""
    grad_norm_tighten: float = Field(2.0, gt=1)
    """Tighten when the gradient norm exceeds this multiple of its median over earlier steps."""
    grad_norm_loosen: float = Field(1.5, gt=0)
    """Loosen only while it is at most this multiple of that median."""
    wait_share_loosen: float = Field(0.2, ge=0, le=1)
    """Loosen only when the trainer waited for its batch at least this share of its step time
    (the bound holds producers back: a looser one lets them run ahead)."""

    @model_validator(mode="after")
    def _ordered(self) -> "AutoStalenessSettings":
        if not self.min <= self.start <= self.max:
            raise ValueError(f"need min <= start <= max, got {self.min}, {self.start}, {self.max}")
        if self.ess_loosen < self.ess_tighten or self.kl_loosen > self.kl_tighten\
                or self.grad_norm_loosen > self.grad_norm_tighten:
            raise ValueError("each loosen threshold must be on the healthy side of its tighten "
                             "threshold (ess_loosen >= ess_tighten, kl_loosen <= kl_tighten, "
                             "grad_norm_loosen <= grad_norm_tighten)")
        return self


class StalenessSettings(ControlSettings):
    """The `staleness` section: the start values of the runtime settings.
    (Records the gate drops are counted, `rlstream_consumer_records_total{outcome="dropped_stale"}`;
    no copy of them is kept.)"""

    auto: AutoStalenessSettings = AutoStalenessSettings()
    """Limits and thresholds of `max_staleness: auto` (unused otherwise)."""

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        """`max_staleness: auto`: the controller owns the bound, starting at `auto.start`."""
        if isinstance(data, dict) and data.get("max_staleness") == "auto":
            auto = data.get("auto")
            start = auto.get("start") if isinstance(auto, dict) else getattr(auto, "start", None)
            start = AutoStalenessSettings.model_fields["start"].default if start is None else start
            data = {**data, "max_staleness": start, "max_staleness_auto": True}
        return data

    @model_validator(mode="after")
    def _within_limits(self) -> "StalenessSettings":
        if self.max_staleness_auto and not self.auto.min <= self.max_staleness <= self.auto.max:
            raise ValueError(f"max_staleness {self.max_staleness} is outside staleness.auto's limits "
                             f"[{self.auto.min}, {self.auto.max}]")
        return self


class HttpSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """/metrics, /healthz and the admin API. 0 picks a free port (logged)."""
    admin_token: str | None = None
    """Bearer token of the admin API (env RLSTREAM_ADMIN_TOKEN, see ENV_ALIASES). None: admin off."""


class LivenessSettings(_Section):
    """When GET /healthz turns 503: the loop has work and makes no progress (common/control/liveness.py)."""

    stall_after_s: float = Field(1800.0, gt=0, le=86400)
    """Not live once work has waited this long without a train step. Set it above the
    slowest loop iteration (train step + checkpoint + publish: minutes for the 30B recipes)."""


class ConsumerLivenessSettings(LivenessSettings):
    intake_stall_after_s: float = Field(120.0, gt=0, le=86400)
    """Not ready (GET /readyz 503, reason `intake starved`) once records have waited on the broker
    this long while every poll returned none and no step was trained: the broker does not
    deliver (consumer/stream/intake.py `IntakeWatch`). Readiness, not liveness: the loop is not
    wedged, and a restart would not make the broker deliver."""


class ProducerLivenessSettings(LivenessSettings):
    stall_after_s: float = Field(300.0, gt=0, le=86400)
    """Not live once requests in the engine have waited this long without an engine step
    (a step takes milliseconds to seconds)."""
    weight_update_limit_s: float = Field(900.0, gt=0, le=86400)
    """Not live once following the trainer (a reload: stage, verify and load a version; a
    collective receive) has blocked the loop this long. Above the load time of the largest
    version (a 61 GB durable copy: minutes)."""


class CliSettings(_Section):
    """The `rlstream` command itself: the log level of every subcommand and the
    service `rlstream ctl` talks to."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Log level of every rlstream process (env RLSTREAM_LOG_LEVEL, flag --log-level); case-insensitive."""
    admin_url: str = "http://127.0.0.1:8081"
    """HTTP address of the service `rlstream ctl` calls (env RLSTREAM_ADMIN_URL, flag ctl --url)."""
    admin_token: str | None = None
    """Bearer token `rlstream ctl` sends (env RLSTREAM_ADMIN_TOKEN, flag ctl --token)."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_name(cls, v):
        if not isinstance(v, str):
            return v
        v = v.strip().upper()
        return {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(v, v)  # the aliases logging itself accepts
