"""The rollout driver: how the producer turns admitted tasks into records.

The service's loop (producer/service.py) knows one driver and no modes:

    follow_control -> evict_stale -> admit (driver.start) -> engine step
        -> driver.on_finished -> outbox

Three drivers implement it (chosen once, by `build_driver` in producer/rollout/build.py):

- `SingleTurn` (single_turn.py): one engine sample per rollout, G submitted
  together (n=G: the engine shares the prompt's prefix), scored by the task;
- `Episodes` (episodes.py): multi-turn episodes against an environment
  (common/tasks/envs/), one `EpisodeRunner` interleaving them in the engine;
- `Agents` (agents/driver.py): black-box agents over the OpenAI-compatible endpoint;
  they open their groups themselves (`admits_prompts` False) through the same
  admission gate, so the service's admit step leaves them alone.

Every driver builds its records through `Trajectory.to_rollout`
(trajectory.py) and marks a group's samples done in `InFlightGroups`
(producer/groups.py), whose size admission counts.
"""
from __future__ import annotations

from rlstream.common.record import Rollout
from rlstream.common.tasks.task import Task
from rlstream.producer.sample import FinishedSample


class RolloutDriver:
    """The protocol, with the defaults a driver may keep."""

    admits_prompts = True
    """False: the driver opens its groups itself (agents over HTTP), not the service's admit step."""
    url: str | None = None
    """An endpoint the driver serves (the run file names it), or None."""

    def start(self, group_id: str, task: Task, G: int) -> None:
        """Start the G rollouts of a newly admitted group (already in InFlightGroups)."""
        raise NotImplementedError

    def on_finished(self, samples: list[FinishedSample]) -> list[Rollout]:
        """Take the engine's finished requests (possibly none: a driver may have other work, an
        environment's answer or an agent's call); returns the records to publish."""
        raise NotImplementedError

    def has_work(self) -> bool:
        """Work the driver still waits on besides the engine's requests."""
        raise NotImplementedError

    def evict_stale(self, trainer_version: int, max_staleness: int) -> None:
        """Abort the groups the trainer can no longer take (only single-turn groups do so today:
        episodes and agents keep their requests)."""

    def on_delivered(self, fut) -> None:
        """The broker acknowledged a record (the publisher's thread; `fut.rollout_id` names it)."""

    def drain(self, deadline: float) -> None:
        """Shutdown begins: take no new work; the service keeps stepping until `deadline`."""

    def abort(self) -> int:
        """Forget every unfinished rollout (the engine aborts its requests itself); returns how many."""
        return 0

    def close(self) -> None:
        pass
