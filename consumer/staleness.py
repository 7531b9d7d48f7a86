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
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ControlSettings
from common.record import Rollout
from consumer.assembler import Group


@dataclass(frozen=True)
class GateDecision:
    keep: bool
    staleness: int
    weights: tuple[float, ...]  # per sample, in group order (empty when dropped)


@dataclass
class ReadyGroup:
    """A group the gate kept, with its staleness and per-sample weights."""

    group: Group
    staleness: int
    weights: tuple[float, ...]


def sample_staleness(r: Rollout, trainer_version: int) -> int:
    return max(0, trainer_version - r.oldest_version)


def gate_group(rollouts: list[Rollout], trainer_version: int, state: ControlSettings) -> GateDecision:
    """Decide one complete group under the current control state."""
    per = [sample_staleness(r, trainer_version) for r in rollouts]
    s = max(per) if per else 0
    if s > state.max_staleness:
        return GateDecision(False, s, ())
    if state.mode == "reweight":
        return GateDecision(True, s, tuple(float(state.decay) ** p for p in per))
    return GateDecision(True, s, tuple(1.0 for _ in per))
