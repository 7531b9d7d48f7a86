"""The journal topic: one compacted partition keyed by episode (and by producer, for leases).

    ep:<group_id>#<sample_idx>   an unfinished episode's newest state (snapshot.py); None = ended
    lease:<producer_id>          {"incarnation", "at"}: the producer is alive (claims.py)

One partition, so every reader sees a lease before the entries its process wrote and
an entry's tombstone after the entry. Writes go through one producer with one request
in flight (acks=all): a retried older state can never land after a newer one.
`JournalTopic.poll()` folds what was written since the last call into `entries` (the
newest state per key that applies, claims.py `applies`; tombstones remove) and `leases`.
Compaction keeps the topic at one value per live key on Apache Kafka; tansu 0.6 does not
compact (docs/kafka.md), so a starting reader begins at the newest checkpoint of the
live state instead (checkpoint.py) and reads only the journal after it.

The journal is input like any topic. A record whose key is not UTF-8, a lease that is not
`{"incarnation": str, "at": number}`, an entry whose header is malformed or stored under
another episode's key is refused: skipped, logged, counted in
`rlstream_producer_journal_refused_total{reason}` (snapshot.py REASONS), and an entry is
queued as a dead letter (`take_letters`: the journal copies it to the DLQ, journal.py).
Times are judged by this reader's clock (claims.py `trusted`): one further ahead than the
skew bound is counted in `rlstream_producer_journal_future_times_total` and taken as now + skew.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass

from rlstream.common.config import KafkaSettings
from rlstream.common.kafka.client import make_admin, make_consumer, make_producer
from rlstream.common.kafka.dlq import DeadLetterWriter
from rlstream.producer import telemetry
from rlstream.producer.journal import checkpoint
from rlstream.producer.journal.claims import Lease, applies, skew_bound, trusted
from rlstream.producer.journal.snapshot import (
    MAX_ID,
    MAX_INCARNATION,
    JournalError,
    Snapshot,
    decode,
    encode,
    held,
)

log = logging.getLogger("rlstream.producer.journal")
MAX_LETTERS = 64
"""Refused entries queued for the DLQ at most (more are counted and logged only)."""


def journal_topic(kafka: KafkaSettings) -> str:
    return kafka.topics.journal or f"{kafka.topics.rollouts}.journal"


def ensure_journal_topic(kafka: KafkaSettings) -> str:
    """Create the journal topic (compacted, one partition) and its checkpoints topic if
    missing; returns the journal's name."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    name = journal_topic(kafka)
    admin = make_admin(kafka)
    try:
        have = set(admin.list_topics())
        configs = {"cleanup.policy": "compact", "max.message.bytes": str(kafka.max_message_bytes)}
        for topic in (name, checkpoint.checkpoint_topic(name)):
            if topic not in have:
                try:
                    admin.create_topics([NewTopic(topic, 1, kafka.topics.replication_factor, topic_configs=configs)])
                except TopicAlreadyExistsError:
                    pass
    finally:
        admin.close()
    return name


@dataclass(frozen=True)
class Letter:
    """A refused journal record, as the DLQ writer takes it (common/kafka/dlq.py `Refused`)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str
    message: str
    claimed: bool = False
    """Refused by the producer that claimed it (one copy); else by a reader's fold (every
    reader refuses it: the journal sends it only where it would have claimed the key)."""
    headers: tuple = ()


class JournalTopic:
    """Writer and reader of the journal topic for one producer process."""

    def __init__(self, kafka: KafkaSettings, lease_s: float, max_skew_s: float = 2.0, clock=time.time):
        from kafka import TopicPartition

        self.kafka = kafka
        self.topic = ensure_journal_topic(kafka)
        self._producer = make_producer(kafka, "control", max_in_flight_requests_per_connection=1,
                                       max_request_size=kafka.max_message_bytes)
        self._consumer = make_consumer(kafka, auto_offset_reset="earliest",
                                       max_partition_fetch_bytes=kafka.max_message_bytes + (1 << 20))
        self._tp = TopicPartition(self.topic, 0)
        self._consumer.assign([self._tp])
        self._consumer.seek_to_beginning()
        self.checkpoints = checkpoint.Checkpoints(kafka, checkpoint.checkpoint_topic(self.topic))
        self._dlq = None
        self.init_view(lease_s, max_skew_s, clock)

    def init_view(self, lease_s: float, max_skew_s: float = 2.0, clock=time.time) -> None:
        """The fold's state, empty (a test's in-memory topic calls this alone)."""
        self.lease_s, self.skew_s, self.clock = lease_s, skew_bound(lease_s, max_skew_s), clock
        """`lease_s` judges claims as they are folded (claims.py `applies`): every producer of
        one journal must use the same (`producer.journal.lease_s`)."""
        self.entries: dict = {}
        """key -> claims.Held of the newest entry that applies."""
        self.snapshots: dict[str, bytes] = {}
        """key -> the newest entry's bytes (decoded only when claimed)."""
        self.offsets: dict[str, int] = {}
        """key -> the newest entry's journal offset (a dead letter's source)."""
        self.leases: dict[str, Lease] = {}
        self.newest_at = 0.0
        """The newest time a lease or entry read so far carries (as trusted): the journal's
        clock as this reader has seen it (a reader behind the topic must not take live peers for dead)."""
        self.position = 0
        """The next journal offset to fold."""
        self.folded = 0
        """Journal records folded by this reader (a checkpoint's count as one)."""
        self.checkpointed_at = 0
        """The journal offset of the newest checkpoint this reader loaded or wrote."""
        self.tombstoned: set[str] = set()
        """Episode keys whose tombstone was folded since the last `take_tombstoned()`."""
        self.letters: list[Letter] = []
        self._starting = False

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

    def start(self, writes: list, timeout_s: float = 120.0) -> None:
        """Fold the newest checkpoint (if any), then the journal from its offset past `writes`."""
        self._starting = True
        try:
            value = self.checkpoints.newest()
            if value is not None:
                self.load_checkpoint(value)
            self.read_past(writes, timeout_s)
        finally:
            self._starting = False

    def load_checkpoint(self, value: bytes) -> None:
        """Fold checkpoint `value` into an empty view and read the journal on from its offset."""
        try:
            offset, leases, entries = checkpoint.decode(value)
        except JournalError as e:
            self._refuse(e.reason, str(e))
            return
        for pid, (incarnation, at) in leases.items():
            self._fold(f"lease:{pid}", json.dumps({"incarnation": incarnation, "at": at}).encode(), -1)
        for key, at, entry in entries:
            self._install(key, entry, at)
        self.position = self.checkpointed_at = offset
        self.folded += 1
        self._consumer.seek(self._tp, offset)

    def checkpoint_due(self, every: int) -> bool:
        return self.position - self.checkpointed_at >= every

    def write_checkpoint(self) -> None:
        """Send the live state folded so far as a checkpoint at `position` (checkpoint.py)."""
        leases = {p: (lease.incarnation, lease.at) for p, lease in self.leases.items()}
        entries = [(k, self.offsets.get(k, -1), v) for k, v in self.snapshots.items()]
        value = checkpoint.encode(self.position, leases, entries)
        self.checkpointed_at = self.position
        if len(value) > self.kafka.max_message_bytes:
            log.warning("journal checkpoint of %d bytes exceeds kafka.max_message_bytes: not written (starting "
                        "producers read from the previous one)", len(value))
            return
        self.checkpoints.write(value)
        telemetry.JOURNAL_CHECKPOINTS.inc()

    def poll(self) -> None:
        """Fold what is fetched now, in bounded time (a few polls). To know that everything
        written before some point is folded, use `read_past` or `sync`."""
        for _ in range(10):
            batches = self._consumer.poll(timeout_ms=0, max_records=2000)
            for messages in batches.values():
                for m in messages:
                    self._fold_message(m)
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
                    self._fold_message(m)

    def _fold_message(self, m) -> None:
        self.position = max(self.position, m.offset + 1)
        try:
            key = m.key.decode() if m.key else ""
        except UnicodeDecodeError:
            self._refuse("key", f"journal record at offset {m.offset}: its key is not UTF-8", m.key, m.value, m.offset)
            return
        self._fold(key, m.value, m.offset)

    def _fold(self, key: str, value: bytes | None, offset: int = -1) -> None:
        self.folded += 1
        if key.startswith("lease:"):
            if value is not None:
                self._fold_lease(key, value)
            return
        if value is None:
            if key.startswith("ep:"):
                self.tombstoned.add(key)
            self.forget(key)
            return
        new = self._held(key, value, offset)
        if new is not None and applies(self.entries.get(key), new, self.leases, self.lease_s):
            self._store(key, new, value, offset)  # (else: a claim lost to an earlier one, or a write
            # by a process that no longer holds the entry)

    def _install(self, key: str, value: bytes, offset: int) -> None:
        """An entry of a checkpoint: the state after the writes were applied, checked as read."""
        new = self._held(key, value, offset)
        if new is not None:
            self._store(key, new, value, offset)

    def _held(self, key: str, value: bytes, offset: int):
        """The entry's header as this reader trusts it (claims.Held); None if refused."""
        try:  # the header alone: the arrays are decoded only for an entry this reader claims
            new = held(key, value)
        except JournalError as e:
            self._refuse(e.reason, str(e), key.encode(), value, offset)
            return None
        return dataclasses.replace(new, at=self._trust(new.written_at))

    def _store(self, key: str, new, value: bytes, offset: int) -> None:
        self.entries[key] = new
        self.newest_at = max(self.newest_at, new.when)
        self.snapshots[key] = bytes(value)
        self.offsets[key] = offset

    def _fold_lease(self, key: str, value: bytes) -> None:
        pid = key[len("lease:"):]
        try:
            d = json.loads(value)
            incarnation, at = d["incarnation"], d["at"]
            if not (isinstance(incarnation, str) and 1 <= len(incarnation) <= MAX_INCARNATION
                    and isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
                    and 1 <= len(pid) <= MAX_ID):
                raise ValueError("want {\"incarnation\": a string of 1..64 characters, \"at\": a finite number} "
                                 f"under lease:<a producer id of 1..{MAX_ID} characters>")
        except Exception as e:  # noqa: BLE001 - not JSON, not a map, a field missing or of the wrong type
            self._refuse("lease", f"journal lease {key[:80]!r} refused ({type(e).__name__}: {e})"[:300])
            return
        at = self._trust(float(at))
        self.leases[pid] = Lease(pid, incarnation, at)
        self.newest_at = max(self.newest_at, at)

    def _trust(self, t: float) -> float:
        now = self.clock()
        if t > now + self.skew_s:
            telemetry.JOURNAL_FUTURE_TIMES.inc()
            log.warning("journal time %.1f s ahead of this producer's clock: taken as %.1f s ahead "
                        "(producer.journal.max_clock_skew_s)", t - now, self.skew_s)
        return trusted(t, now, self.skew_s)

    def _refuse(self, reason: str, why: str, key: bytes | None = None, value: bytes | None = None,
                offset: int = -1, claimed: bool = False) -> None:
        telemetry.JOURNAL_REFUSED.labels(reason=reason).inc()
        log.warning("journal record refused (%s): %s", reason, why)
        if value is not None and (claimed or not self._starting) and len(self.letters) < MAX_LETTERS:
            self.letters.append(Letter(self.topic, 0, offset, key, value, reason, why, claimed))

    def decoded(self, key: str) -> Snapshot | None:
        """The newest entry of `key`, decoded; None (refused, counted, and forgotten) if it does not decode."""
        try:
            return decode(self.snapshots[key])
        except JournalError as e:
            self.refuse_entry(key, e)
            return None

    def refuse_entry(self, key: str, e: JournalError) -> None:
        """The claimed entry of `key` is refused: counted, forgotten here, queued as a dead letter."""
        self._refuse(e.reason, str(e), key.encode(), self.snapshots.get(key), self.offsets.get(key, -1), claimed=True)
        self.forget(key)

    def forget(self, key: str) -> None:
        self.entries.pop(key, None)
        self.snapshots.pop(key, None)
        self.offsets.pop(key, None)

    def take_tombstoned(self) -> set[str]:
        out, self.tombstoned = self.tombstoned, set()
        return out

    def take_letters(self) -> list[Letter]:
        out, self.letters = self.letters, []
        return out

    def send_letters(self, letters: list[Letter]) -> None:
        """Store refused entries in the DLQ (original key and bytes, reason headers); a failure
        is logged, not raised: the record stays in the journal, and its refusal is counted."""
        if not letters:
            return
        try:
            self._dlq = self._dlq or DeadLetterWriter(self.kafka)
            for letter in letters:
                self._dlq.send(letter, f"journal.{letter.reason}", letter.message)
            self._dlq.confirm()
        except Exception as e:  # noqa: BLE001 - the DLQ is best effort here: the journal keeps the record
            log.warning("%d refused journal records not copied to the DLQ: %s", len(letters), e)

    def close(self) -> None:
        self.checkpoints.close()
        if self._dlq is not None:
            self._dlq.close()
        for c in (self._producer, self._consumer):
            try:
                c.close(timeout=5) if c is self._producer else c.close()
            except Exception as e:  # noqa: BLE001 - closing is best effort
                log.debug("journal client close: %s", e)
