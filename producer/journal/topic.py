"""The journal topic: one compacted partition keyed by episode (and by producer, for leases).

    ep:<group_id>#<sample_idx>   an unfinished episode's newest state (snapshot.py); None = ended
    lease:<producer_id>          {"incarnation", "at"}: the producer is alive (claims.py)

One partition, so every reader sees a lease before the entries its process wrote and
an entry's tombstone after the entry. Writes go through one producer with one request
in flight (acks=all): a retried older state can never land after a newer one.
`JournalTopic.poll()` folds what was written since the last call into `entries` (the
newest state per key that applies, claims.py `applies`; tombstones remove) and `leases`. Compaction keeps the topic at
one value per live key on Apache Kafka; tansu 0.6 does not compact (docs/kafka.md), so
there a reader's start-up scan grows with the journal's history.
"""
from __future__ import annotations

import json
import logging
import time

from common.config import KafkaSettings
from common.kafka.client import make_admin, make_consumer, make_producer
from producer import telemetry
from producer.journal.claims import Held, Lease, applies
from producer.journal.snapshot import JournalError, Snapshot, decode, encode, held_fields

log = logging.getLogger("rlstream.producer.journal")


def journal_topic(kafka: KafkaSettings) -> str:
    return kafka.topics.journal or f"{kafka.topics.rollouts}.journal"


def ensure_journal_topic(kafka: KafkaSettings) -> str:
    """Create the journal topic (compacted, one partition) if missing; returns its name."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    name = journal_topic(kafka)
    admin = make_admin(kafka)
    try:
        if name not in set(admin.list_topics()):
            configs = {"cleanup.policy": "compact", "max.message.bytes": str(kafka.max_message_bytes)}
            try:
                admin.create_topics([NewTopic(name, 1, kafka.topics.replication_factor, topic_configs=configs)])
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
    return name


class JournalTopic:
    """Writer and reader of the journal topic for one producer process."""

    def __init__(self, kafka: KafkaSettings, lease_s: float):
        from kafka import TopicPartition

        self.topic, self.lease_s = ensure_journal_topic(kafka), lease_s
        """`lease_s` judges claims as they are folded (claims.py `applies`): every producer of
        one journal must use the same (`producer.journal.lease_s`)."""
        self._producer = make_producer(kafka, "control", max_in_flight_requests_per_connection=1,
                                       max_request_size=kafka.max_message_bytes)
        self._consumer = make_consumer(kafka, auto_offset_reset="earliest",
                                       max_partition_fetch_bytes=kafka.max_message_bytes + (1 << 20))
        self._tp = TopicPartition(self.topic, 0)
        self._consumer.assign([self._tp])
        self._consumer.seek_to_beginning()
        self.entries: dict[str, Held] = {}
        self.snapshots: dict[str, bytes] = {}
        """key -> the newest entry's bytes (decoded only when claimed)."""
        self.leases: dict[str, Lease] = {}
        self.newest_at = 0.0
        """The newest time a lease or entry read so far carries: the journal's clock as this
        reader has seen it (a reader behind the topic must not take live peers for dead)."""

    # -- writing (any thread: KafkaProducer.send is thread-safe)

    def put(self, s: Snapshot):
        """Send `s`; returns kafka-python's future of its record metadata."""
        value = encode(s)
        fut = self._producer.send(self.topic, key=s.key.encode(), value=value)
        telemetry.JOURNAL_WRITES.inc()
        telemetry.JOURNAL_BYTES.inc(len(value))
        return fut

    def tombstone(self, key: str) -> None:
        try:
            self._producer.send(self.topic, key=key.encode(), value=None)
        except Exception as e:  # noqa: BLE001 - e.g. an acknowledgement after close: the entry is
            log.warning("journal tombstone of %s not sent (%s); a peer resumes it again", key, e)  # deduped by id

    def renew_lease(self, producer_id: str, incarnation: str):
        """Write the lease; returns kafka-python's future of its record metadata."""
        value = json.dumps({"incarnation": incarnation, "at": time.time()}).encode()
        return self._producer.send(self.topic, key=f"lease:{producer_id}".encode(), value=value)

    def sync(self, timeout_s: float = 30.0) -> None:
        """Fold everything written to the journal before this call (a no-op marker is written
        and read past: `read_past`)."""
        self.read_past([self._producer.send(self.topic, key=b"sync", value=None)], timeout_s)

    def flush(self, timeout_s: float = 10.0) -> None:
        self._producer.flush(timeout=timeout_s)

    # -- reading (the service's thread)

    def poll(self) -> None:
        """Fold what is fetched now, in bounded time (a few polls). To know that everything
        written before some point is folded, use `read_past` or `sync`."""
        for _ in range(10):
            batches = self._consumer.poll(timeout_ms=0, max_records=2000)
            for messages in batches.values():
                for m in messages:
                    self._fold(m.key.decode() if m.key else "", m.value)
            if not batches:
                return

    def read_past(self, writes: list, timeout_s: float = 30.0) -> None:
        """Wait for `writes` (futures of `put`) to be acknowledged, then fold the journal up
        to and including them: what every reader will have decided about them is known here.
        (A fetch's high watermark may predate the writes: reading to it is not enough.)
        Raises if a write failed or the journal is not read past it within `timeout_s`."""
        offsets = [f.get(timeout=timeout_s).offset for f in writes if f is not None]
        if not offsets:
            return
        deadline = time.monotonic() + timeout_s
        while self._consumer.position(self._tp) <= max(offsets):
            if time.monotonic() > deadline:
                raise TimeoutError(f"journal {self.topic} not read past offset {max(offsets)} within {timeout_s} s")
            for messages in self._consumer.poll(timeout_ms=200, max_records=2000).values():
                for m in messages:
                    self._fold(m.key.decode() if m.key else "", m.value)

    def _fold(self, key: str, value: bytes | None) -> None:
        if key.startswith("lease:"):
            if value is not None:
                d = json.loads(value)
                pid = key[len("lease:"):]
                self.leases[pid] = Lease(pid, str(d["incarnation"]), float(d["at"]))
                self.newest_at = max(self.newest_at, float(d["at"]))
            return
        if value is None:
            self.entries.pop(key, None)
            self.snapshots.pop(key, None)
            return
        try:  # the header alone: the arrays are decoded only for an entry this reader claims
            holder, incarnation, written_at, claimed_from = held_fields(value)
        except JournalError as e:
            telemetry.JOURNAL_BAD_ENTRIES.inc()
            log.warning("journal entry %s skipped: %s", key, e)
            return
        if not applies(self.entries.get(key), holder, incarnation, claimed_from, written_at, self.leases,
                       self.lease_s):
            return  # a claim lost to an earlier one, or a write by a process that no longer holds it
        self.entries[key] = Held(key, holder, incarnation, written_at)
        self.newest_at = max(self.newest_at, written_at)
        self.snapshots[key] = bytes(value)

    def decoded(self, key: str) -> Snapshot | None:
        """The newest entry of `key`, decoded; None (counted, and forgotten) if it does not decode."""
        try:
            return decode(self.snapshots[key])
        except JournalError as e:
            telemetry.JOURNAL_BAD_ENTRIES.inc()
            log.warning("journal entry %s skipped: %s", key, e)
            self.entries.pop(key, None)
            self.snapshots.pop(key, None)
            return None

    def close(self) -> None:
        for c in (self._producer, self._consumer):
            try:
                c.close(timeout=5) if c is self._producer else c.close()
            except Exception as e:  # noqa: BLE001 - closing is best effort
                log.debug("journal client close: %s", e)
