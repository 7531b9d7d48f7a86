"""The consumer's driver of `max_staleness: auto`.

    auto = AutoStaleness(cfg.staleness.auto, writer.set_control)
    auto.after_step(step_metrics, phases, control)      # after every global step

After each step it hands the controller (consumer/stability/controller.py) the
step's signals under the bound in force, and publishes a change the one way every
runtime setting changes: a record on the control topic (`set_control`, as
`CONTROLLER`, with the reason), which every service, this one included, applies
at its next batch boundary. While `max_staleness_auto` is off (an operator set
the bound) it does nothing but forget its window. A failed write is logged and
counted; the controller tries again after a fresh window (training goes on).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from rlstream.common.config import AutoStalenessSettings, ControlSettings
from rlstream.common.control.messages import CONTROLLER
from rlstream.consumer import telemetry
from rlstream.consumer.stability.controller import Change, StalenessController, StepSignals

log = logging.getLogger("rlstream.consumer.stability")


def step_signals(step_metrics: dict, phases: dict[str, float]) -> StepSignals:
    """What the controller reads from a step: ESS, the sampler-vs-trainer KL over every record,
    the gradient norm, and the share of the step the trainer waited for its batch."""
    total = sum(phases.values())
    return StepSignals(ess=step_metrics.get("ess"), kl=step_metrics.get("kl_train_inference"),
                       grad_norm=step_metrics.get("grad_norm"),
                       wait_share=phases.get("wait", 0.0) / total if total > 0 else 0.0)


class AutoStaleness:
    def __init__(self, cfg: AutoStalenessSettings, set_control: Callable[..., Any]):
        self.cfg = cfg
        self.controller = StalenessController(cfg)
        self.set_control = set_control
        self.last: dict | None = None
        """The last change published: bound, direction, signal, reason, at (unix s)."""
        self._owned = False

    def after_step(self, step_metrics: dict, phases: dict[str, float], state: ControlSettings) -> Change | None:
        """Feed one step; publish and return the change it decides (None: none)."""
        telemetry.observe_auto(state.max_staleness_auto and state.max_staleness <= self.cfg.min)
        if not state.max_staleness_auto:
            if self._owned:
                log.info("max_staleness %d set by an operator: the controller stands by", state.max_staleness)
                self.controller.reset()
            self._owned = False
            return None
        self._owned = True
        change = self.controller.observe(step_signals(step_metrics, phases), state.max_staleness)
        if change is not None:
            self._publish(change)
        return change

    def _publish(self, change: Change) -> None:
        try:
            self.set_control("max_staleness", change.bound, CONTROLLER, change.reason)
        except Exception as e:  # noqa: BLE001 - a broker hiccup must not stop training
            telemetry.count_auto_change(change.direction, change.signal, published=False)
            log.warning("max_staleness auto: could not publish %s (%s); trying again after a window",
                        change.reason, e)
            return
        telemetry.count_auto_change(change.direction, change.signal, published=True)
        self.last = {"bound": change.bound, "direction": change.direction, "signal": change.signal,
                     "reason": change.reason, "at": time.time()}
        log.info("max_staleness auto: %s", change.reason)

    def status(self, state: ControlSettings) -> dict:
        """For GET /admin/control: whether the controller owns the bound, its limits and last change."""
        return {"max_staleness_controller": {
            "owns_bound": state.max_staleness_auto, "min": self.cfg.min, "max": self.cfg.max,
            "steps_in_window": len(self.controller.window), "window": self.cfg.window, "last_change": self.last}}
