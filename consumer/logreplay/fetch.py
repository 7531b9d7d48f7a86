"""The records each replayed step trained, read back from the topic by offset.

Every step's records are known before the replay starts (its audit lines), so
each partition is read forward once, from the first offset any step needs: a
step's records are taken from a buffer of the wanted records already passed,
or read for, partition by partition, up to the highest offset the step needs
there; records no step needs are skipped undecoded. A group the live consumer
held for a while was trained after records further on in its partition, so
the buffer holds the wanted records read ahead of their step (the live
consumer's read-ahead, no more), never the topic.

Nothing is silently replaced. A record that is no longer on the topic
(deleted by retention, or a topic recreated since), a claim check whose blob
is gone or fails its check, or a record that is not the rollout the audit
line names fails the replay with a ReplayError naming the step, the record
(topic/partition/offset, rollout id) and, for a claim check, the blob.
"""
from __future__ import annotations

import time

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import InvalidRecordError
from rlstream.common.kafka.claimcheck import AbstractBlobStore, resolve
from rlstream.common.kafka.scan import TopicScan
from rlstream.common.record import RecordLimits, Rollout
from rlstream.consumer.logreplay import ReplayError
from rlstream.consumer.logreplay.record import StepInputs

STALL_S = 60.0
"""A partition that returns nothing for this long while records are still wanted from it fails the replay."""


class StepRecords:
    """`take(step)`: that step's rollouts, in its batch order."""

    def __init__(self, kafka: KafkaSettings, steps: list[StepInputs], blobs: AbstractBlobStore | None,
                 limits: RecordLimits):
        topics = {s.topic for s in steps}
        if len(topics) > 1:
            raise ReplayError(f"the steps read from several topics {sorted(topics)}; replay them one range "
                              "at a time (--from/--to-step)")
        self.topic = topics.pop() if topics else kafka.topics.rollouts
        self.blobs, self.limits = blobs, limits
        self._wanted = {(p, o): (s.step, rid) for s in steps for (p, o), rid in zip(s.records, s.trained)}
        self._buffer: dict[tuple[int, int], bytes | None] = {}
        self.read_bytes = 0
        self.scan = TopicScan(kafka, self.topic)
        self._check_retained()
        first: dict[int, int] = {}
        for p, o in self._wanted:
            first[p] = min(first.get(p, o), o)
        self.scan.seek(first)

    def _check_retained(self) -> None:
        starts = self.scan.log_starts()
        for (p, o), (step, rid) in sorted(self._wanted.items(), key=lambda kv: kv[1][0]):
            if p not in starts:
                raise ReplayError(f"step {step}: record {self.topic}/{p}/{o} (rollout {rid}): the topic has no "
                                  f"partition {p} (it has {sorted(starts)}); was it recreated?")
            if o < starts[p]:
                raise ReplayError(f"step {step}: record {self.topic}/{p}/{o} (rollout {rid}) is no longer on the "
                                  f"topic (partition {p} now starts at {starts[p]}: deleted by retention); a "
                                  "replay needs every record of the steps it runs (docs/log.md, Retention)")

    def take(self, s: StepInputs) -> list[Rollout]:
        self._read_until(s)
        out = []
        for (p, o), rid in zip(s.records, s.trained):
            value = self._buffer.pop((p, o))
            self._wanted.pop((p, o), None)
            out.append(self._decode(s.step, p, o, rid, value))
        return out

    def _read_until(self, s: StepInputs) -> None:
        last_progress = time.monotonic()
        while missing := [(p, o) for p, o in s.records if (p, o) not in self._buffer]:
            self._check_passed(s, missing)
            msgs = self.scan.poll(only={p for p, _ in missing})
            for m in msgs:
                if (m.partition, m.offset) in self._wanted:
                    self._buffer[(m.partition, m.offset)] = m.value
                    self.read_bytes += len(m.value or b"")
            if msgs:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > STALL_S:
                p, o = missing[0]
                raise ReplayError(f"step {s.step}: no record of {self.topic}/{p} past offset "
                                  f"{self.scan.position(p)} within {STALL_S:.0f} s while record {o} is wanted")

    def _check_passed(self, s: StepInputs, missing: list[tuple[int, int]]) -> None:
        """A wanted offset the scan passed (or the partition's end) without finding it is not on the topic."""
        for p, o in missing:
            end = self.scan.end(p)
            if o < self.scan.position(p) or (end is not None and o >= end):
                rid = s.trained[s.records.index((p, o))]
                raise ReplayError(f"step {s.step}: record {self.topic}/{p}/{o} (rollout {rid}) is not on the "
                                  f"topic (partition {p} ends at {end}); was the topic recreated or compacted?")

    def _decode(self, step: int, p: int, o: int, rid: str, value: bytes | None) -> Rollout:
        where = f"step {step}: record {self.topic}/{p}/{o} (rollout {rid})"
        try:
            r, pointer = resolve(value, self.blobs, self.limits)
        except InvalidRecordError as e:
            if e.field == "claim_check":
                raise ReplayError(f"{where} is a claim check whose blob cannot be read: {e.reason}. The blob "
                                  "store must keep every blob the replayed steps point to (docs/log.md, "
                                  "Retention)") from None
            raise ReplayError(f"{where} does not decode: {e}") from None
        if r.rollout_id != rid:
            raise ReplayError(f"{where} holds rollout {r.rollout_id}, not the one the audit line names: the "
                              "topic is not the one the run read (recreated?)")
        return r

    def close(self) -> None:
        self.scan.close()
