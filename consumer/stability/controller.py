"""`max_staleness: auto` as pure logic: each step's signals in, now and then a new bound out.

    ctl = StalenessController(cfg.staleness.auto)
    change = ctl.observe(StepSignals(ess=..., kl=..., grad_norm=..., wait_share=...), bound=3)
    if change: publish(change.bound, change.reason)

Rules (thresholds: common/config/shared.py `AutoStalenessSettings`):

- The controller judges the mean of the steps observed since its last change
  (or start, or a bound it did not set), once there are `window` of them; a
  change starts a fresh window. Records sampled under the old bound keep
  arriving for a while, so a window under the new bound is what it waits for
  (this is its cooldown).
- degraded: ESS < ess_tighten, or KL > kl_tighten, or gradient norm >
  grad_norm_tighten x the median gradient norm of the steps before the window
  (the baseline, up to `BASELINE_STEPS` of them; no baseline, no verdict on it).
  Then the bound halves (AIMD: a fast retreat), never below `min`.
- healthy: ESS >= ess_loosen, KL <= kl_loosen and gradient norm <= grad_norm_loosen
  x baseline (a missing signal counts as healthy). With the trainer having
  waited for its batches (mean wait share >= wait_share_loosen) the bound grows,
  never above `max`: it doubles until the first tightening (a slow start, as
  TCP's: a healthy pipeline reaches its loosest bound in a few windows), then
  grows by one.
- Between the two (the hysteresis band), or healthy with a trainer that does
  not wait: the bound holds.

A bound set by someone else (an operator, then `auto` again) restarts the window
from that bound; the controller never fights it within the window.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from rlstream.common.config import AutoStalenessSettings

BASELINE_STEPS = 32
"""Gradient norms kept for the baseline median (steps before the current window)."""


@dataclass(frozen=True)
class StepSignals:
    """What the controller reads from one global step (None: not measured this step)."""

    ess: float | None = None
    kl: float | None = None
    grad_norm: float | None = None
    wait_share: float = 0.0
    """The share of the step's wall time the trainer waited for its batch."""


@dataclass(frozen=True)
class Change:
    bound: int
    direction: str
    """tighten or loosen."""
    signal: str
    """What decided it: ess, kl, grad_norm (tighten; the first that degraded) or healthy (loosen)."""
    reason: str
    """One line for the control record, the log and the admin API."""


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


class StalenessController:
    def __init__(self, cfg: AutoStalenessSettings):
        self.cfg = cfg
        self.window: list[StepSignals] = []
        self.baseline: deque[float] = deque(maxlen=BASELINE_STEPS)
        self.bound: int | None = None
        """The bound the window runs under (the last one observed)."""
        self.slow_start = True
        """Loosening doubles the bound until the first tightening, then adds one."""

    def observe(self, s: StepSignals, bound: int) -> Change | None:
        """One step's signals under `bound` (the bound now in force); a change to publish, or None."""
        if bound != self.bound:  # a change of ours taking effect, or someone else's bound
            self._restart(bound)
        self.window.append(s)
        if len(self.window) < self.cfg.window:
            return None
        change = self._decide(bound)
        if change is not None:
            self._restart(change.bound)
        return change

    def reset(self) -> None:
        """Forget the window (the operator took the bound) and start slow again; the
        gradient-norm baseline stays."""
        self._restart(None)
        self.slow_start = True

    def _restart(self, bound: int | None) -> None:
        self.baseline.extend(w.grad_norm for w in self.window if w.grad_norm is not None)
        self.window, self.bound = [], bound

    def _slide(self) -> None:
        """No change: the oldest step leaves the window (into the gradient-norm baseline)."""
        old = self.window.pop(0)
        if old.grad_norm is not None:
            self.baseline.append(old.grad_norm)

    def _decide(self, bound: int) -> Change | None:
        c = self.cfg
        ess, kl = _mean(w.ess for w in self.window), _mean(w.kl for w in self.window)
        gn, wait = _mean(w.grad_norm for w in self.window), _mean(w.wait_share for w in self.window)
        base = statistics.median(self.baseline) if self.baseline else None
        gn_x = gn / base if gn is not None and base else None
        degraded = [(name, text) for name, bad, text in (
            ("ess", ess is not None and ess < c.ess_tighten, f"ess {_g(ess)} < {c.ess_tighten}"),
            ("kl", kl is not None and kl > c.kl_tighten, f"kl {_g(kl)} > {c.kl_tighten}"),
            ("grad_norm", gn_x is not None and gn_x > c.grad_norm_tighten,
             f"grad norm {_g(gn_x)} x its median > {c.grad_norm_tighten}")) if bad]
        new = max(c.min, bound // 2)
        if degraded and new < bound:
            self.slow_start = False
            return Change(new, "tighten", degraded[0][0],
                          f"tighten {bound} -> {new}: " + "; ".join(t for _, t in degraded))
        healthy = ((ess is None or ess >= c.ess_loosen) and (kl is None or kl <= c.kl_loosen)
                   and (gn_x is None or gn_x <= c.grad_norm_loosen))
        if not degraded and healthy and wait is not None and wait >= c.wait_share_loosen and bound < c.max:
            new = min(c.max, max(2 * bound, bound + 1) if self.slow_start else bound + 1)
            return Change(new, "loosen", "healthy",
                          f"loosen {bound} -> {new}: healthy (ess {_g(ess)}, kl {_g(kl)}, grad norm "
                          f"{_g(gn_x)} x its median) and the trainer waited {_g(wait)} of its steps")
        self._slide()
        return None


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
