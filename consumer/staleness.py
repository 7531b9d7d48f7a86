"""The staleness gate: drop or reweight groups by policy lag, never silently.

Staleness of a sample = trainer version at the optimizer step - the sample's
oldest token version (`Rollout.oldest_version`). A group is judged by its
stalest sample: its G samples share one advantage baseline, so the group is
kept or dropped whole.

- `drop`: keep a group iff staleness <= max_staleness; weight 1.
- `reweight`: same bound; kept samples get weight `decay ** staleness`
  (on top of the trainer's token-level IS weight pi_old/mu_old, which corrects
  both the discrepancy and the staleness gap). decay = 1 means the IS weight
  alone does the correction.
A group newer than the trainer (negative staleness: a version the trainer has
not reached, e.g. after a restore from an older checkpoint) is kept with
staleness 0.

Dynamic sampling (`consumer.dynamic_sampling`, resolved by
`ConsumerSettings.filters_zero_variance`): a group within the bound whose G
rewards are all equal is filtered, outcome `filtered`: its group-relative
advantage is 0 for every sample, so it carries no gradient, and the batch is
filled from the stream instead. Staleness is judged first (a stale group is
`dropped_stale` whatever its rewards). `FilteredShare` is the share of groups
within the bound that were filtered, over the last `FILTER_WINDOW_BATCHES` x B
of them: the trainer sends it to the producers (`TrainerProgress.filtered_share`),
which admit that much more so that filtering does not starve the trainer
(producer/admission.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.config import ControlSettings
from common.record import Rollout
from consumer.assembler import Group


FILTER_WINDOW_BATCHES = 8
"""FilteredShare looks at the last 8 x B groups within the staleness bound (~8 steps
without filtering): recent enough to follow the policy, long enough to be steady."""


@dataclass(frozen=True)
class GateDecision:
    keep: bool
    staleness: int
    weights: tuple[float, ...]  # per sample, in group order (empty when dropped)
    outcome: str | None = None
    """Why the group is not kept (the ledger outcome): dropped_stale or filtered; None when kept."""


@dataclass
class ReadyGroup:
    """A group the gate kept, with its staleness and per-sample weights."""

    group: Group
    staleness: int
    weights: tuple[float, ...]


def sample_staleness(r: Rollout, trainer_version: int) -> int:
    return max(0, trainer_version - r.oldest_version)


def zero_variance(rollouts: list[Rollout]) -> bool:
    """All rewards of the group are equal (exactly: equal floats give an advantage of exactly 0)."""
    return len({r.reward for r in rollouts}) <= 1


def gate_group(rollouts: list[Rollout], trainer_version: int, state: ControlSettings,
               filter_zero_variance: bool = False) -> GateDecision:
    """Decide one complete group under the current control state (and dynamic sampling)."""
    per = [sample_staleness(r, trainer_version) for r in rollouts]
    s = max(per) if per else 0
    if s > state.max_staleness:
        return GateDecision(False, s, (), "dropped_stale")
    if filter_zero_variance and zero_variance(rollouts):
        return GateDecision(False, s, (), "filtered")
    if state.mode == "reweight":
        return GateDecision(True, s, tuple(float(state.decay) ** p for p in per))
    return GateDecision(True, s, tuple(1.0 for _ in per))


class FilteredShare:
    """The share of recent groups within the staleness bound that dynamic sampling filtered."""

    def __init__(self, window: int):
        self._recent: deque[bool] = deque(maxlen=window)

    def note(self, d: GateDecision) -> None:
        """Count one gate decision (stale groups are not counted: they were never trainable)."""
        if d.outcome != "dropped_stale":
            self._recent.append(d.outcome == "filtered")

    @property
    def value(self) -> float:
        """filtered / (filtered + kept) over the window; 0 before any group."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0
