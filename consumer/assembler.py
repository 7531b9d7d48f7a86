"""Group assembly: wait for all G samples of a prompt, time out the rest.

Samples of one group arrive on one partition (the group id is the Kafka key)
but interleaved with other groups. The assembler holds partial groups until
they are complete, or until `timeout_s` after their first sample, when they
are dropped and counted (a producer that died mid-group never gets a partial
group trained).

It also remembers, per partition, the smallest offset it still holds: the
consumer checkpoints that (not the reader's position), so a restart re-reads
every record that was held but not yet trained. Duplicates (a publisher retry,
or a re-read after a restart) are recognised by `rollout_id` and skipped.
Records of another group size never get here: the reader refuses them
(consumer/intake.py), and `add` raises InvalidSampleError if one does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.errors import InvalidSampleError
from common.record import Rollout


@dataclass
class Held:
    rollout: Rollout
    partition: int
    offset: int


@dataclass
class Group:
    group_id: str
    group_size: int
    first_seen: float
    samples: dict[int, Held] = field(default_factory=dict)  # sample_idx -> Held

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.group_size

    def rollouts(self) -> list[Rollout]:
        return [self.samples[i].rollout for i in sorted(self.samples)]

    def offsets(self) -> list[tuple[int, int]]:
        return [(h.partition, h.offset) for h in self.samples.values()]


@dataclass
class AddResult:
    """What `add` did with one record."""

    outcome: str  # "held", "completed", "duplicate"
    group: Group | None = None


class GroupAssembler:
    """Collects samples into complete groups of `group_size`."""

    def __init__(self, group_size: int, timeout_s: float, clock=time.monotonic,
                 dedup_window: int = 200_000):
        self.group_size, self.timeout_s, self.clock = group_size, timeout_s, clock
        self._open: dict[str, Group] = {}
        # rollout_ids already held/trained/dropped, oldest first; bounded so a
        # service running for weeks keeps flat memory (~100 B per id).
        self._seen: dict[str, None] = {}
        self.dedup_window = dedup_window

    def mark_seen(self, rollout_ids) -> None:
        """Rollout ids a checkpoint says were already processed (skip on re-read)."""
        for rid in rollout_ids:
            self._remember(rid)

    def _remember(self, rid: str) -> None:
        self._seen[rid] = None
        while len(self._seen) > self.dedup_window:
            del self._seen[next(iter(self._seen))]

    def add(self, r: Rollout, partition: int, offset: int) -> AddResult:
        if r.group_size != self.group_size:  # a bug: the reader's limits refuse these (DLQ, field group_size)
            raise InvalidSampleError(f"record {r.rollout_id!r} has group_size {r.group_size}, this consumer "
                                     f"{self.group_size}; build the reader with consumer.intake.record_limits")
        if r.rollout_id in self._seen:
            return AddResult("duplicate")
        g = self._open.get(r.group_id)
        if g is None:
            g = self._open[r.group_id] = Group(r.group_id, r.group_size, self.clock())
        if r.sample_idx in g.samples:  # same slot, another rollout_id: keep the first
            self._remember(r.rollout_id)
            return AddResult("duplicate")
        self._remember(r.rollout_id)
        g.samples[r.sample_idx] = Held(r, partition, offset)
        if g.complete:
            del self._open[r.group_id]
            return AddResult("completed", g)
        return AddResult("held", g)

    def expire(self) -> list[Group]:
        """Remove and return incomplete groups older than the timeout."""
        now = self.clock()
        old = [g for g in self._open.values() if now - g.first_seen > self.timeout_s]
        for g in old:
            del self._open[g.group_id]
        return old

    def pending_min_offsets(self) -> dict[int, int]:
        """Per partition, the smallest offset of a record still held."""
        out: dict[int, int] = {}
        for g in self._open.values():
            for h in g.samples.values():
                out[h.partition] = min(out.get(h.partition, h.offset), h.offset)
        return out

    def open_groups(self) -> list[Group]:
        return list(self._open.values())

    @property
    def num_open(self) -> int:
        return len(self._open)
