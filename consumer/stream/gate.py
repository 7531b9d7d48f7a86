"""The staleness gate: drop or reweight groups by policy lag, never silently.

Staleness of a sample = trainer version at the optimizer step - the sample's
oldest model token's version (`Rollout.oldest_version`; a multi-turn record's
environment tokens were never sampled, so their version does not count). A group is judged by its
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

After a crash (`GateClock`), staleness is counted in optimizer steps of the
model's lineage, not in version numbers: the restored model continues under a
version above every one the dead incarnation announced (versions are never
reused, consumer/service.py), so version numbers run ahead of the steps the
model really took, and the records of the lost steps, re-read to be trained
again, would look that much staler. A version maps to the step whose model it
was (`step_of`; equal until the first crash), and a record already gated
before the crash (trained in a lost step: the audit log says which) is judged
at the step it was first gated at: the redo keeps what the lost step kept.

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

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from rlstream.common.config import ControlSettings
from rlstream.common.record import Rollout
from rlstream.common.staleness import is_stale, staleness_of
from rlstream.consumer.stream.assembler import Group


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
    ages: tuple[int, ...] = ()
    """Per sample, in group order: its own staleness (the group's is the largest); empty when dropped."""


@dataclass
class ReadyGroup:
    """A group the gate kept, with its staleness and per-sample weights and ages."""

    group: Group
    staleness: int
    weights: tuple[float, ...]
    ages: tuple[int, ...]


def sample_staleness(r: Rollout, trainer_version: int) -> int:
    return staleness_of(trainer_version, r.oldest_version)


def zero_variance(rollouts: list[Rollout]) -> bool:
    """All rewards of the group are equal (exactly: equal floats give an advantage of exactly 0)."""
    return len({r.reward for r in rollouts}) <= 1


class GateClock:
    """Where the gate measures staleness from, in optimizer steps of this model's lineage.

    `anchors`: (version, step) pairs, "version v was the model of step s": each
    incarnation's first version after a crash renumbered it (consumer/service.py);
    versions count one per step from an anchor until the next. Every version ever
    announced, of a dead incarnation too, maps to the step whose model it was: a
    dead step's version maps to the step number the redo gives that step again.
    `first_gated`: rollout_id -> the step a record was first gated at, for the
    records trained in steps lost at a crash: the redo judges them there, so a
    batch put together in another order does not age them (the reader may return
    the re-read partitions in another interleaving than the live run saw)."""

    def __init__(self, anchors: Iterable[tuple[int, int]] = (), first_gated: dict[str, int] | None = None):
        self._anchors: dict[int, int] = {0: 0}
        self._versions = [0]  # the anchors' versions, sorted
        for version, step in anchors:
            self.anchor(version, step)
        self.first_gated = dict(first_gated or {})

    def anchor(self, version: int, step: int) -> None:
        """Version `version` is the model of step `step` (a later note for a version replaces an earlier one)."""
        self._anchors[int(version)] = int(step)
        self._versions = sorted(self._anchors)

    def step_of(self, version: int) -> int:
        """The step whose model `version` was (in the lineage, or in a dead one at the same step number)."""
        v0 = self._versions[max(0, bisect.bisect_right(self._versions, version) - 1)]
        return self._anchors[v0] + version - v0

    def trained(self, rollout_ids: Iterable[str]) -> None:
        """These records are trained in the lineage now: no redo judges them again."""
        for rid in rollout_ids:
            self.first_gated.pop(rid, None)

    def staleness(self, trainer_step: int) -> Callable[[Rollout], int]:
        """Per-sample staleness for a group gated at optimizer step `trainer_step`."""
        def of(r: Rollout) -> int:
            at = min(trainer_step, self.first_gated.get(r.rollout_id, trainer_step))
            return staleness_of(at, self.step_of(r.oldest_version))
        return of


def gate_group(rollouts: list[Rollout], trainer_version: int, state: ControlSettings,
               filter_zero_variance: bool = False,
               staleness: Callable[[Rollout], int] | None = None) -> GateDecision:
    """Decide one complete group under the current control state (and dynamic sampling).
    `staleness`: per sample (the service's `GateClock`); default: `sample_staleness`
    at `trainer_version`."""
    per = [staleness(r) if staleness is not None else sample_staleness(r, trainer_version) for r in rollouts]
    s = max(per) if per else 0
    if is_stale(s, state.max_staleness):
        return GateDecision(False, s, (), "dropped_stale")
    if filter_zero_variance and zero_variance(rollouts):
        return GateDecision(False, s, (), "filtered")
    if state.mode == "reweight":
        return GateDecision(True, s, tuple(float(state.decay) ** p for p in per), ages=tuple(per))
    return GateDecision(True, s, tuple(1.0 for _ in per), ages=tuple(per))


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
