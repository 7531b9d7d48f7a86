"""Rollout reader: Kafka -> validated rollouts, invalid ones -> the DLQ, explicit offsets.

The trainer owns its offsets: the reader assigns partitions directly (no
consumer group, so no join/rebalance wait), never commits to Kafka, and
exposes `positions()` for the checkpoint and `start_offsets` / `seek()` to
resume from one.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable

from rlstream.common import metrics
from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError, InvalidRecordError, OffsetError
from rlstream.common.kafka.claimcheck import AbstractBlobStore, open_blob_store, resolve
from rlstream.common.kafka.client import FETCH_OVERHEAD_BYTES, end_offsets, make_consumer
from rlstream.common.kafka.dlq import DeadLetterWriter
from rlstream.common.kafka.fetch_wait import FETCH_WAIT_CAP_MS, FetchWait
from rlstream.common.record import DEFAULT_LIMITS, RecordLimits, Rollout

log = logging.getLogger("rlstream.reader")

_READ = metrics.counter("rlstream_read_records_total", "Valid rollout records returned by readers")
_READ_BYTES = metrics.counter("rlstream_read_bytes_total", "Kafka value bytes of records read (valid or not)")
_DLQ = metrics.counter("rlstream_dlq_records_total", "Invalid records sent to the DLQ (broker-acknowledged)",
                       ["field"])
_LAG = metrics.gauge("rlstream_reader_lag_records", "Records in assigned partitions not yet read (last lag() call)")

INTERNAL_FIELD = "<internal>"
"""DLQ field of a record whose decoding raised something other than InvalidRecordError (a bug)."""


@dataclass(frozen=True)
class ReadItem:
    partition: int
    offset: int
    rollout: Rollout
    claim_check: bool = False
    """True if the record arrived as a claim-check pointer (resolved from the blob store)."""
    message: Any = dataclass_field(default=None, repr=False, compare=False)
    """The Kafka message it was read from (for `refuse`)."""


class RolloutReader:
    """Reads `kafka.topics.rollouts` from explicitly assigned partitions.

    Delivery guarantee: after any `poll()` call returned, every record of an
    assigned partition p at an offset in [start, positions()[p]) -- start being
    the offset the reader was constructed or last `seek()`ed to -- was either
    returned by a `poll()` of this reader, or is stored in the DLQ topic
    (broker-acknowledged, acks=all) with headers `rlstream-reason`,
    `rlstream-field`, `rlstream-source` = "topic/partition/offset" and its
    original key and bytes, and counted once in
    `rlstream_dlq_records_total{field}`. `positions()` never moves past a
    record that is neither (dead letters go through `rlstream.common.kafka.dlq`, which
    confirms them before `poll()` advances). If the DLQ send fails, `poll()` raises BrokerError,
    returns nothing and leaves `positions()` unchanged, so the next `poll()`
    reads the same records again (the DLQ may then hold a record twice).

    Nothing is committed to Kafka: the trainer stores `positions()` in its
    checkpoint and resumes with `start_offsets=` that dict, so delivery to the
    trainer is at least once and exactly-once training comes from the
    checkpoint plus dedup by `rollout_id`.

    Validation: a record is valid iff `rlstream.common.record` decodes and validates it,
    a claim-check pointer resolves to a blob that passes its size and sha256
    check and holds the rollout the pointer names, the Kafka key equals
    the record's group_id (the partitioning invariant), and `check` (the
    caller's own rules, e.g. the consumer's version bound, consumer/stream/intake.py)
    returns instead of raising InvalidRecordError. Single-threaded.

    Fetch wait: `fetch_max_wait_ms` is the floor; a poll that returns nothing
    while the broker's high watermark says records wait doubles it, up to
    `max_fetch_wait_ms` (common/kafka/fetch_wait.py: tansu answers such fetches
    empty once a partition's log is longer than the wait can list), and the
    reader goes on with a new consumer at the same positions. `fetch_wait`
    says where it stands.
    """

    def __init__(self, kafka: KafkaSettings, partitions: list[int] | None = None,
                 start_offsets: dict[int, int] | None = None, blobs: AbstractBlobStore | None = None,
                 limits: RecordLimits = DEFAULT_LIMITS, *, topic: str | None = None,
                 fetch_max_wait_ms: int = 100, check: Callable[[Rollout], None] | None = None,
                 max_fetch_wait_ms: int = FETCH_WAIT_CAP_MS):
        from kafka import TopicPartition

        self.kafka = kafka
        self.topic = topic or kafka.topics.rollouts
        self.limits = limits
        self._check = check
        self._blobs = blobs
        self._dlq = DeadLetterWriter(kafka)
        self.dlq_total = 0
        """Records this reader stored in the DLQ (broker-acknowledged)."""
        self._dead_since_take: list[tuple[int, int]] = []
        self.fetch_wait = FetchWait("rollouts", fetch_max_wait_ms, max_fetch_wait_ms,
                                    kafka.request_timeout_ms)
        self._consumer = self._new_consumer()
        known = self._partitions_for_topic()
        parts = sorted(known) if partitions is None else sorted(set(partitions))
        missing = set(parts) - known
        if missing:
            self._consumer.close()
            raise BrokerError(f"topic {self.topic} has no partition(s) {sorted(missing)} (it has {sorted(known)})")
        self._tps = {p: TopicPartition(self.topic, p) for p in parts}
        self._consumer.assign(list(self._tps.values()))
        start_offsets = dict(start_offsets or {})
        extra = set(start_offsets) - set(parts)
        if extra:
            self._consumer.close()
            raise OffsetError(f"start_offsets names partition(s) {sorted(extra)} of {self.topic}, but this reader "
                              f"is assigned {parts}; a checkpoint from a topic with other partitions?")
        self._positions: dict[int, int] = {}
        for p, tp in self._tps.items():
            if p in start_offsets:
                self._consumer.seek(tp, int(start_offsets[p]))
            else:
                self._consumer.seek_to_beginning(tp)
            self._positions[p] = int(self._consumer.position(tp))

    def _new_consumer(self):
        """A consumer with this reader's fetch sizes and its current fetch wait (not yet assigned)."""
        per_partition = self.kafka.max_message_bytes + FETCH_OVERHEAD_BYTES
        fetch_max = max(52_428_800, per_partition)
        return make_consumer(
            self.kafka, auto_offset_reset="earliest", fetch_max_bytes=fetch_max, max_partition_fetch_bytes=per_partition,
            receive_message_max_bytes=fetch_max + FETCH_OVERHEAD_BYTES, fetch_max_wait_ms=self.fetch_wait.ms,
            check_crcs=True)

    def _adapt_fetch_wait(self, raw) -> None:
        """After a poll that returned nothing while records wait: the next fetches wait longer
        (common/kafka/fetch_wait.py), through a new consumer at the same positions."""
        at = {tp: self._positions[p] for p, tp in self._tps.items()}
        if not self.fetch_wait.raise_for(self.fetch_wait.starved(self._consumer, raw, at), at):
            return
        old, self._consumer = self._consumer, self._new_consumer()
        old.close()
        self._consumer.assign(list(self._tps.values()))
        for tp, offset in at.items():
            self._consumer.seek(tp, offset)

    def _partitions_for_topic(self) -> set[int]:
        deadline = time.monotonic() + self.kafka.request_timeout_ms / 1000
        while True:
            parts = self._consumer.partitions_for_topic(self.topic)
            if parts:
                return set(parts)
            if time.monotonic() > deadline:
                self._consumer.close()
                raise BrokerError(f"topic {self.topic} does not exist on {self.kafka.bootstrap_servers}; "
                                  "create it with rlstream.common.kafka.client.ensure_topics (rlstream broker does)")
            time.sleep(0.1)

    # ------------------------------------------------------------------ read
    def poll(self, max_records: int = 64, timeout_s: float = 1.0) -> list[ReadItem]:
        """Up to `max_records` valid rollouts (waiting up to `timeout_s` for the first).

        Invalid records are sent to the DLQ and confirmed before this returns.
        """
        raw = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        if not raw:
            self._adapt_fetch_wait(raw)
        items: list[ReadItem] = []
        dead: list[tuple[str, int, int]] = []  # (field, partition, offset) sent to the DLQ, not yet confirmed
        advance: dict[int, int] = {}
        nbytes = 0
        try:
            for tp, msgs in raw.items():
                for m in msgs:
                    nbytes += len(m.value or b"")
                    try:
                        rollout, claim = self._decode(m)
                        items.append(ReadItem(tp.partition, m.offset, rollout, claim, m))
                    except InvalidRecordError as e:
                        self._dlq.send(m, e.field, e.reason)
                        dead.append((e.field, tp.partition, m.offset))
                    except Exception as e:  # a decoder bug must not stop training; it is loud in the DLQ
                        log.exception("unexpected %s decoding %s/%d/%d", type(e).__name__, m.topic, m.partition,
                                      m.offset)
                        self._dlq.send(m, INTERNAL_FIELD, f"{type(e).__name__}: {e}")
                        dead.append((INTERNAL_FIELD, tp.partition, m.offset))
                    advance[tp.partition] = m.offset + 1
            if dead:
                self._dlq.confirm()
        except BaseException as e:
            for p in advance:  # re-read this batch on the next poll; positions() stays where it was
                self._consumer.seek(self._tps[p], self._positions[p])
            if isinstance(e, Exception):
                why = str(e) if isinstance(e, BrokerError) else f"{type(e).__name__}: {e}"
                raise BrokerError(f"{why}; positions unchanged, the next poll reads these records again") from e
            raise
        self._positions.update(advance)
        for field, partition, offset in dead:
            _DLQ.labels(field).inc()
            self._dead_since_take.append((partition, offset))
        self.dlq_total += len(dead)
        _READ.inc(len(items))
        _READ_BYTES.inc(nbytes)
        return items

    def _decode(self, m) -> tuple[Rollout, bool]:
        if self._blobs is None:
            self._blobs = open_blob_store(self.kafka.blob_dir)
        r, pointer = resolve(m.value, self._blobs, self.limits)
        claim = pointer is not None
        if m.key != r.group_id.encode():
            raise InvalidRecordError("key", f"Kafka key {m.key[:80] if m.key else m.key!r} != group_id "
                                     f"{r.group_id!r} (a group must stay in one partition)")
        if self._check is not None:
            self._check(r)
        return r, claim

    def refuse(self, refusals: list[tuple[ReadItem, str, str]]) -> None:
        """Store records this reader returned that the caller refuses, as (item, field,
        reason), in the DLQ like its own dead letters (original bytes, reason headers,
        counted in `rlstream_dlq_records_total{field}`), confirmed before this returns;
        BrokerError if they could not be stored. Not returned by `take_dead`: the
        caller counts its own refusals."""
        for it, fld, reason in refusals:
            self._dlq.send(it.message, fld, reason)
        self._dlq.confirm()
        for _, fld, _ in refusals:
            _DLQ.labels(fld).inc()
        self.dlq_total += len(refusals)

    def take_dead(self) -> list[tuple[int, int]]:
        """(partition, offset) of records sent to the DLQ since the previous call.

        The consumer counts each once, by position, even when it re-reads them
        after a restart.
        """
        out, self._dead_since_take = self._dead_since_take, []
        return out

    # --------------------------------------------------------------- offsets
    @property
    def partitions(self) -> list[int]:
        return list(self._tps)

    def positions(self) -> dict[int, int]:
        """Next offset to consume per assigned partition (store it in the checkpoint)."""
        return dict(self._positions)

    def seek(self, offsets: dict[int, int]) -> None:
        """Continue each given partition at the given offset (e.g. from a checkpoint)."""
        unknown = set(offsets) - set(self._tps)
        if unknown:
            raise OffsetError(f"seek names partition(s) {sorted(unknown)} of {self.topic}, but this reader is "
                              f"assigned {sorted(self._tps)}")
        for p, off in offsets.items():
            if off < 0:
                raise OffsetError(f"offset {off} for partition {p} of {self.topic} must be >= 0")
            self._consumer.seek(self._tps[p], int(off))
            self._positions[p] = int(off)

    def end_offsets(self) -> dict[int, int]:
        """End offset per assigned partition (`rlstream.common.kafka.client.end_offsets`: the fetch-reported
        high watermark where known, which is right on tansu too). BrokerError if the broker does not answer."""
        return end_offsets(self._consumer, self._tps.values(), self.kafka.request_timeout_ms)

    def lag(self) -> int:
        """Records in the assigned partitions at or after positions() (see end_offsets)."""
        ends = self.end_offsets()
        total = sum(max(0, ends[p] - pos) for p, pos in self._positions.items())
        _LAG.set(total)
        return total

    def close(self) -> None:
        self._dlq.close()
        self._consumer.close()

    def __enter__(self) -> "RolloutReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
