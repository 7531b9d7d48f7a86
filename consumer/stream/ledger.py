"""The exactly-once ledger: what the consumer holds, what got its outcome,
and what a checkpoint commits.

Every record the reader hands over (a valid rollout, or a dead letter it put
in the DLQ) is at any moment in exactly one of two states:

- held: in a partial group (the assembler), in a complete group waiting for a
  batch (`complete`), or in a gated group of the batch being built
  (`building`);
- done: counted once in one outcome of OUTCOMES: trained, dropped_stale,
  timed_out, duplicate (another record with a rollout_id already seen: a
  publisher retry), dlq (refused by the reader: undecodable, invalid, or
  not for this consumer, e.g. another group size, consumer/stream/intake.py; or
  refused by the assembler: a group id reused by another copy or after its
  group closed, consumer/stream/assembler.py) or filtered (dynamic sampling: a
  complete group whose rewards are all equal, consumer/stream/gate.py).

A reused group id is refused here, when read, before any group reaches the
trainer: the record is counted `dlq` and handed to the service
(`take_refused`), which stores it in the DLQ with its reason (field
`group_id`) before it reads on, so no checkpoint covers a refusal not stored.
A fenced copy (an older journal claim's, consumer/stream/assembler.py) goes the same way
(field `claim_epoch`), also when a newer claim's copy replaces it in an open group.

So, at any moment, records read = sum(counters) + held_records().

A checkpoint (`to_checkpoint`) commits, per partition, the smallest offset of
a held record (the reader's position where nothing is held), so it never
passes a held record and a restart re-reads every one of them; and the
(partition, offset, rollout_id) of the done records at or above those offsets,
and the assembler's window of closed group ids (a reuse after a restart is
refused too; the ids of held groups are not in it: they are re-read).
`from_checkpoint` restores the counters and that list: a re-read done record
(same partition and offset) is skipped without being counted again. Its
rollout_id is marked seen only then, when the reader passes it: a later copy
(a retry, always on the same partition: the key is the group id) still counts
as a duplicate, while an earlier record with that id, held when the
checkpoint was written, is re-read first and taken as the original (marking
every listed id at restore would turn that held original into a "duplicate"
and time its group out). Hence after a restart nothing is counted twice,
nothing is lost, and a record is trained at most once in the lineage of the
model a checkpoint holds (steps after the last checkpoint die with a crash and
are redone from its offsets: consumer/checkpoint/cadence.py, consumer/checkpoint/files.py).

Pure: no Kafka, no clock of its own. The service feeds it what the reader
returned (`read`) and the reader's positions (`to_checkpoint`); unit tests
feed it by hand (tests/unit/consumer/test_ledger.py).
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol

from rlstream.common.record import Rollout
from rlstream.consumer.stream.assembler import Group, GroupAssembler
from rlstream.consumer.checkpoint.files import CheckpointState

OUTCOMES = ("trained", "dropped_stale", "timed_out", "duplicate", "dlq", "filtered")


class ReadRecord(Protocol):
    """What the reader returns for a valid record (rlstream.common.kafka.reader.ReadItem)."""

    partition: int
    offset: int
    rollout: Rollout


class Ledger:
    """Held groups, outcome counters and the processed list of one consumer."""

    def __init__(self, assembler: GroupAssembler, on_count: Callable[[str, int], None] | None = None):
        self.assembler = assembler
        self.counters: dict[str, float] = {k: 0.0 for k in OUTCOMES}
        self.complete: list[Group] = []
        """Complete groups, not yet gated, oldest first."""
        self.building: list[Group] = []
        """Gated and kept, in the batch being built: held until `trained()`."""
        self._done: dict[tuple[int, int], str] = {}  # (partition, offset) -> rollout_id, since the checkpoint
        self._on_count = on_count or (lambda outcome, n: None)
        self._refused: list[tuple[ReadRecord, str]] = []  # counted `dlq`, for the service to store in the DLQ
        self._fenced: list[tuple[ReadRecord, str]] = []  # the same, fenced copies (field claim_epoch)

    # ------------------------------------------------------------ records in

    def read(self, items: Iterable[ReadRecord], dead: Iterable[tuple[int, int]] = ()) -> None:
        """Account for one poll: the (partition, offset) of the dead letters the
        reader confirmed in the DLQ, then its valid records."""
        for p, o in dead:
            if (p, o) not in self._done:  # a re-read puts it in the DLQ again; counted once
                self._finish([(p, o, f"dlq:{p}:{o}")], "dlq")
        for it in items:
            if (rid := self._done.get((it.partition, it.offset))) is not None:
                self.assembler.mark_seen([rid])  # re-read after a restart: it has its outcome
                continue
            res = self.assembler.add(it.rollout, it.partition, it.offset, it)
            if res.outcome in ("duplicate", "timed_out"):  # timed_out: a late sample of a timed-out group
                self._finish([(it.partition, it.offset, it.rollout.rollout_id)], res.outcome)
            elif res.outcome in ("reused", "fenced"):
                self._finish([(it.partition, it.offset, it.rollout.rollout_id)], "dlq")
                (self._refused if res.outcome == "reused" else self._fenced).append((it, res.reason))
            elif res.outcome == "completed":
                self.complete.append(res.group)
            if (old := res.superseded) is not None:
                self._finish([(old.partition, old.offset, old.rollout.rollout_id)], "dlq")
                self._fenced.append((old.source, res.reason))

    def take_fenced(self) -> list[tuple[ReadRecord, str]]:
        """(record, reason) of the copies fenced since the last call (an older journal claim's:
        consumer/stream/assembler.py): counted `dlq`, for the caller to store in the DLQ (field `claim_epoch`)."""
        out, self._fenced = self._fenced, []
        return out

    def take_refused(self) -> list[tuple[ReadRecord, str]]:
        """(record, reason) of the records refused for a reused group id since the last
        call: counted `dlq`, for the caller to store in the DLQ (field `group_id`)."""
        out, self._refused = self._refused, []
        return out

    def expire(self) -> list[Group]:
        """Partial groups past the assembler's timeout, counted `timed_out`."""
        groups = self.assembler.expire()
        for g in groups:
            self._finish_group(g, "timed_out")
        return groups

    # ------------------------------------------------------------ the batch

    def take(self) -> Group | None:
        """The oldest complete group, moved into the batch being built (None: none waits)."""
        if not self.complete:
            return None
        g = self.complete.pop(0)
        self.building.append(g)
        return g

    def drop(self, g: Group, outcome: str = "dropped_stale") -> None:
        """A group taken into the batch that the gate refused (dropped_stale or filtered)."""
        self.building.remove(g)
        self._finish_group(g, outcome)

    def trained(self) -> list[str]:
        """The batch being built was trained: count it; its rollout ids, in batch order."""
        ids = [r.rollout_id for g in self.building for r in g.rollouts()]
        for g in self.building:
            self._finish_group(g, "trained")
        self.building = []
        return ids

    def put_back(self) -> None:
        """The batch being built goes back, untrained, to the front of `complete` (a stop)."""
        self.complete[:0] = self.building
        self.building = []

    # ------------------------------------------------------------ queries

    def held_records(self) -> int:
        """Records read and not yet counted in an outcome (re-read after a restart)."""
        return sum(len(g.samples) for g in self._held_groups())

    def safe_offsets(self, positions: dict[int, int]) -> dict[int, int]:
        """Per partition: the smallest held offset, else the reader's position."""
        safe = dict(positions)
        for g in self._held_groups():
            for p, o in g.offsets():
                safe[p] = min(safe.get(p, o), o)
        return safe

    def _held_groups(self) -> list[Group]:
        return self.assembler.open_groups() + self.complete + self.building

    # ------------------------------------------------------------ checkpoints

    def to_checkpoint(self, step: int, version: int, positions: dict[int, int]) -> CheckpointState:
        """The state to commit with the model of `step`; forgets the done records
        below the committed offsets (they are never re-read)."""
        safe = self.safe_offsets(positions)
        self._done = {(p, o): rid for (p, o), rid in self._done.items() if o >= safe.get(p, 0)}
        return CheckpointState(step, version, safe, [[p, o, rid] for (p, o), rid in self._done.items()],
                               dict(self.counters), closed_groups=self.assembler.closed_groups())

    @classmethod
    def from_checkpoint(cls, st: CheckpointState, assembler: GroupAssembler,
                        on_count: Callable[[str, int], None] | None = None) -> "Ledger":
        """The ledger a checkpoint committed, for a reader that resumes at `st.offsets`."""
        ledger = cls(assembler, on_count)
        ledger.counters.update(st.counters)
        ledger._done = {(int(p), int(o)): str(rid) for p, o, rid in st.processed}
        assembler.mark_closed(st.closed_groups)
        return ledger

    # ------------------------------------------------------------ outcomes

    def _finish_group(self, g: Group, outcome: str) -> None:
        self.assembler.retire(g, outcome)  # its id stays closed: a later copy is refused
        self._finish([(h.partition, h.offset, h.rollout.rollout_id) for h in g.samples.values()], outcome)

    def _finish(self, records: list[tuple[int, int, str]], outcome: str) -> None:
        self.counters[outcome] += len(records)
        self._done.update(((p, o), rid) for p, o, rid in records)
        self._on_count(outcome, len(records))
