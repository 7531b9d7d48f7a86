"""Single-turn rollouts: one engine sample per rollout, scored by its task.

A group's G samples go to the engine as one request with n=G (the engine
shares the prompt's prefix across them). Each finished sample is decoded,
scored (`task.score`, bound at the prompt source) and turned into its record
as a one-turn trajectory.

Stale eviction (producer/eviction.py): groups the trainer can no longer take
within max_staleness are aborted in the engine and their slots freed.
"""
from __future__ import annotations

from rlstream.common.record import Rollout
from rlstream.producer.eviction import StaleEviction
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.rollout.driver import RolloutDriver
from rlstream.common.tasks.task import Task
from rlstream.producer.rollout.trajectory import Trajectory
from rlstream.producer.sample import FinishedSample, SamplingConfig


class SingleTurn(RolloutDriver):
    def __init__(self, engine, groups: InFlightGroups, sampling: SamplingConfig, producer_id: str):
        self.engine, self.groups, self.sampling, self.producer_id = engine, groups, sampling, producer_id
        self.eviction = StaleEviction()

    def start(self, group_id: str, task: Task, G: int) -> None:
        ids = self.engine.encode(task.prompt)
        self.engine.submit_group(ids, n=G, tag=group_id, sampling=self.sampling)

    def on_finished(self, samples: list[FinishedSample]) -> list[Rollout]:
        records = []
        for s in samples:
            task = self.groups.finish_sample(s.tag).task
            t = Trajectory.of_sample(s)
            reward, t.info = task.score(self.engine.decode(s.response_ids))
            t.reward = float(reward)
            records.append(t.to_rollout(self.producer_id, self.sampling, prompt_text=task.prompt))
        return records

    def has_work(self) -> bool:
        return False  # every rollout in flight is an engine request

    def evict_stale(self, trainer_version: int, max_staleness: int) -> None:
        self.eviction.run(trainer_version, max_staleness, lambda: self.engine.oldest_versions(),
                          lambda gid: self.engine.abort_tag(gid), self.groups)  # looked up only when due
