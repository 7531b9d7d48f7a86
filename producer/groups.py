"""The groups a producer has in flight: G samples of one prompt under one id.

Group ids are `{producer_id}-{incarnation}-{seq}`. The incarnation is random
per process, so ids never repeat, also across restarts of a producer with a
fixed `producer.producer_id`: the consumer assembles groups by id, and a
reused id would mix two prompts in one group.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from rlstream.common.tasks.task import Task


@dataclass
class GroupInfo:
    task: Task
    remaining: int  # samples of the group not finished yet


class InFlightGroups:
    """Groups with samples still generating; `len()` is what admission counts."""

    def __init__(self, producer_id: str):
        self.producer_id = producer_id
        self._incarnation = uuid.uuid4().hex[:8]
        self._seq = 0
        self._groups: dict[str, GroupInfo] = {}

    def new_id(self) -> str:
        self._seq += 1
        return f"{self.producer_id}-{self._incarnation}-{self._seq}"

    def add(self, group_id: str, info: GroupInfo) -> None:
        self._groups[group_id] = info

    def open(self, task: Task, group_size: int) -> str:
        """A new group of `group_size` samples of `task`; returns its id."""
        group_id = self.new_id()
        self.add(group_id, GroupInfo(task, group_size))
        return group_id

    def finish_sample(self, group_id: str) -> GroupInfo:
        """One sample of the group finished; the group is forgotten after its last."""
        info = self._groups[group_id]
        info.remaining -= 1
        if info.remaining == 0:
            del self._groups[group_id]
        return info

    def drop(self, group_id: str) -> None:
        """Forget a group whose unfinished samples were aborted (stale eviction): its
        slot is free for admission; samples it already published stay published."""
        self._groups.pop(group_id, None)

    def get(self, group_id: str) -> GroupInfo | None:
        return self._groups.get(group_id)

    def __len__(self) -> int:
        return len(self._groups)
