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
(consumer/stream/intake.py), and `add` raises InvalidSampleError if one does.

A group id is used once. Its first record opens the group and makes that
record's producer its owner; the group's *copy* is the set of records of that
producer under that id. A record that is no duplicate is refused (`reused`,
with the reason; the service puts it in the DLQ, field `group_id`) when it
- comes from another producer while the group is open (another copy),
- takes a slot (sample_idx) the group already holds under another rollout_id
  (a second copy of the same producer), or
- names a group id that has closed: completed (waiting for its batch, or done)
  or timed out. A late sample of a timed-out group from its own producer is
  counted `timed_out` instead (a slow producer, not a reuse).
So a group is never assembled from two copies, two groups under one id are
never held at once (the trainer asserts that: consumer/train/batch.py), and an id
is never trained twice. Two copies of one producer on disjoint slots cannot
be told apart: they are one group of G samples of that producer under that id.
Why the producer marks a copy: it is the one field every record of a
legitimate group shares whatever the task (a multi-turn environment may give
each sample its own first observation, so the prompt does not), and a
producer's own ids never repeat (`{producer_id}-{incarnation}-{seq}`,
producer/groups.py).

Fencing (docs/multi-turn.md "Durable episodes"). A journaled episode's record carries the
epoch of the journal claim it was published under (`claim_epoch`); a producer cut off past
its lease may publish a copy of an episode a peer took over, under the same rollout_id and
an older epoch. The dedup window keeps each id's newest epoch: a copy with an older epoch
is refused (`fenced`, the DLQ with the reason, field `claim_epoch`); a copy with a newer
epoch replaces an older one still held in an open group (the older goes to the DLQ the
same way, `AddResult.superseded`). A newer copy that arrives after the older one's group
completed is a duplicate: the episode is trained once, from the copy that came first.

Closed ids are remembered in a bounded window (`closed_window` ids once their
group is done; ids of complete groups still held are kept until `retire`), and
a checkpoint carries the window (`closed_groups`, consumer/stream/ledger.py), so a
reuse arriving after a restart is refused too. After a restart a publisher
retry of a record whose group closed before the checkpoint cannot be told
from a reuse (the dedup window of rollout ids is not checkpointed): it is
refused as one, never trained.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlstream.common.errors import InvalidSampleError
from rlstream.common.record import Rollout


@dataclass
class Held:
    rollout: Rollout
    partition: int
    offset: int
    source: object = None
    """What the caller read it as (the ledger's ReadRecord: a superseded copy's dead letter)."""


@dataclass
class Group:
    group_id: str
    group_size: int
    first_seen: float
    producer_id: str = ""
    """The owner: the producer of the group's first record (see the module docstring)."""
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

    outcome: str  # "held", "completed", "duplicate", "reused", "fenced", "timed_out" (a late sample of a timed-out group)
    group: Group | None = None
    reason: str = ""
    """Why a `reused` or `fenced` record is refused (the DLQ reason), or why `superseded` was."""
    superseded: Held | None = None
    """An older claim's copy of this record that it replaced in its open group (to the DLQ)."""


class GroupAssembler:
    """Collects samples into complete groups of `group_size`."""

    def __init__(self, group_size: int, timeout_s: float, clock=time.monotonic,
                 dedup_window: int = 200_000, closed_window: int = 20_000):
        self.group_size, self.timeout_s, self.clock = group_size, timeout_s, clock
        self._open: dict[str, Group] = {}
        # rollout_ids already held/trained/dropped -> the newest claim epoch seen (-1: a
        # checkpoint's, unknown), oldest first; bounded so a service running for weeks keeps
        # flat memory (~100 B per id).
        self._seen: dict[str, int] = {}
        self.dedup_window = dedup_window
        # group ids whose group is done -> (owner, outcome), oldest first; bounded, and
        # checkpointed (~70 B of JSON per id: 1.4 MB at the default window)
        self._closed: dict[str, tuple[str, str]] = {}
        self.closed_window = closed_window
        self._taken: dict[str, str] = {}  # ids of complete groups handed out, not yet retired -> owner

    def mark_seen(self, rollout_ids) -> None:
        """Rollout ids a checkpoint says were already processed (skip on re-read)."""
        for rid in rollout_ids:
            self._remember(rid, -1)

    def _remember(self, rid: str, epoch: int) -> None:
        self._seen[rid] = epoch
        while len(self._seen) > self.dedup_window:
            del self._seen[next(iter(self._seen))]

    def mark_closed(self, closed) -> None:
        """[group_id, owner, outcome] of done groups (a checkpoint's `closed_groups`)."""
        for gid, owner, outcome in closed:
            self._close(str(gid), str(owner), str(outcome))

    def closed_groups(self) -> list[list[str]]:
        """[group_id, owner, outcome] of the done groups in the window, oldest first."""
        return [[gid, owner, outcome] for gid, (owner, outcome) in self._closed.items()]

    def retire(self, g: Group, outcome: str) -> None:
        """A complete group got its outcome (trained, dropped...): its id stays closed, in the window."""
        self._taken.pop(g.group_id, None)
        self._close(g.group_id, g.producer_id, outcome)

    def _close(self, gid: str, owner: str, outcome: str) -> None:
        self._closed.pop(gid, None)  # re-inserted: newest
        self._closed[gid] = (owner, outcome)
        while len(self._closed) > self.closed_window:
            del self._closed[next(iter(self._closed))]

    def add(self, r: Rollout, partition: int, offset: int, source: object = None) -> AddResult:
        if r.group_size != self.group_size:  # a bug: the reader's limits refuse these (DLQ, field group_size)
            raise InvalidSampleError(f"record {r.rollout_id!r} has group_size {r.group_size}, this consumer "
                                     f"{self.group_size}; build the reader with consumer.intake.record_limits")
        if r.rollout_id in self._seen:
            return self._again(r, Held(r, partition, offset, source))
        self._remember(r.rollout_id, r.claim_epoch)
        g = self._open.get(r.group_id)
        refusal = self._refusal(r, g)
        if refusal is not None:
            return refusal
        if g is None:
            g = self._open[r.group_id] = Group(r.group_id, r.group_size, self.clock(), r.producer_id)
        g.samples[r.sample_idx] = Held(r, partition, offset, source)
        if g.complete:
            del self._open[r.group_id]
            self._taken[r.group_id] = g.producer_id
            return AddResult("completed", g)
        return AddResult("held", g)

    def _again(self, r: Rollout, new: Held) -> AddResult:
        """A rollout id seen before: a retry (same claim epoch), a fenced copy (older), or a newer
        claim's copy, which replaces the older one if that is still held in an open group."""
        seen = self._seen[r.rollout_id]
        if r.claim_epoch < seen:
            return AddResult("fenced", reason=f"rollout {r.rollout_id!r} was published under claim epoch "
                             f"{r.claim_epoch}, a peer's epoch {seen} took it over (a producer that lost its "
                             "journal claim: fenced)")
        if r.claim_epoch == seen or seen < 0:
            return AddResult("duplicate")
        self._remember(r.rollout_id, r.claim_epoch)
        g = self._open.get(r.group_id)
        old = g.samples.get(r.sample_idx) if g is not None else None
        if old is None or old.rollout.rollout_id != r.rollout_id:
            return AddResult("duplicate")  # the older copy's group completed: it is the one trained
        g.samples[r.sample_idx] = new
        return AddResult("held", g, reason=f"rollout {r.rollout_id!r} of claim epoch {old.rollout.claim_epoch} is "
                         f"superseded by epoch {r.claim_epoch} (a peer took the episode over: fenced)",
                         superseded=old)

    def _refusal(self, r: Rollout, g: Group | None) -> AddResult | None:
        """Why `r` (no duplicate) may not join group `g` (None: not open), or None if it may."""
        gid, pid = r.group_id, r.producer_id
        if g is not None:
            if pid != g.producer_id:
                return AddResult("reused", reason=f"group_id {gid!r} is held for a copy from producer "
                                 f"{g.producer_id!r}; this record is from {pid!r} (a group id is used once)")
            if r.sample_idx in g.samples:
                held = g.samples[r.sample_idx].rollout.rollout_id
                return AddResult("reused", reason=f"group_id {gid!r} already holds sample {r.sample_idx} "
                                 f"(rollout {held!r}); this rollout {r.rollout_id!r} is a second copy")
            return None
        if gid in self._taken:
            return AddResult("reused", reason=f"group_id {gid!r} is complete and waiting for its batch; "
                             "a group id is used once")
        if gid in self._closed:
            owner, outcome = self._closed[gid]
            if outcome == "timed_out" and owner == pid:
                return AddResult("timed_out")  # a slow producer's late sample, not a reuse
            return AddResult("reused", reason=f"group_id {gid!r} is closed ({outcome}); a group id is used once")
        return None

    def expire(self) -> list[Group]:
        """Remove and return incomplete groups older than the timeout."""
        now = self.clock()
        old = [g for g in self._open.values() if now - g.first_seen > self.timeout_s]
        for g in old:
            del self._open[g.group_id]
            self._close(g.group_id, g.producer_id, "timed_out")
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
