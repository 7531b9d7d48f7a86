"""Engine-side stale eviction: abort in-flight groups the trainer will never take.

The consumer's gate drops a group whose stalest sample is more than
`max_staleness` versions behind the trainer (common/staleness.py, the one
rule both roles apply). The trainer's version only grows, and a sample's
oldest version is fixed by its first sampled token, so once

    staleness_of(trainer_version, oldest_version) > max_staleness

holds for an in-flight group it holds when the group would reach the trainer:
generating the rest of it only burns engine time on a record the consumer
drops. That happens when an operator lowers `max_staleness` at runtime, or
when the trainer ran ahead of a group admitted under the old estimate.

After a consumer crash the gate counts optimizer steps of the model's lineage
(consumer/stream/gate.py `GateClock`) while the restored trainer's version runs
ahead of its steps by the versions the crash skipped; producers see versions
only (`TrainerProgress.trainer_version`), so eviction, like admission, is
stricter than the gate by that gap for the groups dispatched before the crash.

`stale_groups` is that test over the engine's in-flight groups (pure);
`StaleEviction.due` tells the service when to run it: only a rise of the
trainer's version or a fall of `max_staleness` can make a group stale
(admission never starts a stale group, and reloads only make later tokens
newer), so the loop does not walk the in-flight requests on every step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping

from rlstream.common.staleness import is_stale, staleness_of
from rlstream.producer import telemetry

log = logging.getLogger("rlstream.producer")


def stale_groups(oldest_versions: Mapping[Hashable, int], trainer_version: int, max_staleness: int) -> list:
    """The groups (of {group: oldest version of its in-flight samples}) the gate will drop."""
    return [g for g, v in oldest_versions.items() if is_stale(staleness_of(trainer_version, v), max_staleness)]


class StaleEviction:
    """Remembers the (trainer_version, max_staleness) the last check ran under."""

    def __init__(self):
        self._last: tuple[int, int] | None = None

    def due(self, trainer_version: int, max_staleness: int) -> bool:
        """True when the bound moved towards eviction since the last check (the first call: True)."""
        last, self._last = self._last, (trainer_version, max_staleness)
        return last is None or trainer_version > last[0] or max_staleness < last[1]

    def run(self, trainer_version: int, max_staleness: int, oldest_versions: Callable[[], Mapping[str, int]],
            abort: Callable[[str], int], groups) -> None:
        """When `due`: every group the gate will drop is aborted (`abort(group_id)` ends its
        running samples and says how many), its slot freed in `groups` (InFlightGroups), counted."""
        if not self.due(trainer_version, max_staleness):
            return
        for gid in stale_groups(oldest_versions(), trainer_version, max_staleness):
            n = abort(gid)
            groups.drop(gid)
            telemetry.EVICTED_GROUPS.inc()
            telemetry.EVICTED_SAMPLES.inc(n)
            log.info("evicted stale group %s (%d samples running): trainer %d, max_staleness %d",
                     gid, n, trainer_version, max_staleness)
