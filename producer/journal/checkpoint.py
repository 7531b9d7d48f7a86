"""Checkpoints of the journal's live state: a bounded start-up read without compaction.

tansu's memory engine never compacts (docs/kafka.md), so the journal keeps every write
ever made, and a producer that reads it from offset 0 at start reads its whole history.
A checkpoint is the fold of the journal up to some offset O, the live part only: every
lease and every live entry (its bytes and its journal offset). One live producer (the
rendezvous winner of the key "checkpoint" over the live leases, claims.py) writes one
every `producer.journal.checkpoint_every` journal records to `<journal>.checkpoints`
(one partition); a starting producer reads the newest (the partition's last record),
folds it as if it had read those records, and reads the journal from O on. Its start-up
read is then one checkpoint plus at most about `checkpoint_every` records, whatever the
journal's history (tests/bench/journal_start.py measures it).

Value (msgpack): {"v": 1, "offset": O, "leases": {producer_id: [incarnation, at]},
"entries": [[key, journal offset, entry bytes], ...]}. A checkpoint is input like any
record: one that does not parse is refused (JournalError, reason "checkpoint", counted)
and the reader starts from offset 0; its leases and entries are folded through the same
checks as the journal's own (topic.py), so a bad one inside is refused alone.
"""
from __future__ import annotations

import logging
import time

import msgpack

from rlstream.common.config import KafkaSettings
from rlstream.common.kafka.client import make_consumer, make_producer
from rlstream.producer.journal.snapshot import JournalError

log = logging.getLogger("rlstream.producer.journal")
VERSION = 1


def checkpoint_topic(journal: str) -> str:
    return f"{journal}.checkpoints"


def encode(offset: int, leases: dict[str, tuple[str, float]], entries: list[tuple[str, int, bytes]]) -> bytes:
    return msgpack.packb({"v": VERSION, "offset": int(offset),
                          "leases": {p: [inc, float(at)] for p, (inc, at) in leases.items()},
                          "entries": [[k, int(o), bytes(v)] for k, o, v in entries]}, use_bin_type=True)


def decode(value: bytes) -> tuple[int, dict[str, tuple[str, float]], list[tuple[str, int, bytes]]]:
    """(offset, leases, entries) of a checkpoint; JournalError (reason "checkpoint") if malformed."""
    try:
        m = msgpack.unpackb(value, raw=False, strict_map_key=True)
        if not isinstance(m, dict) or m.get("v") != VERSION:
            raise ValueError(f"not a version {VERSION} checkpoint")
        offset, leases, entries = m["offset"], m["leases"], m["entries"]
        if not (isinstance(offset, int) and offset >= 0 and isinstance(leases, dict) and isinstance(entries, list)):
            raise ValueError("offset, leases and entries have the wrong types")
        out_leases = {str(p): (str(inc), float(at)) for p, (inc, at) in leases.items()}
        out_entries = []
        for key, at, v in entries:
            if not (isinstance(key, str) and isinstance(at, int) and isinstance(v, bytes)):
                raise ValueError("an entry is not [key, offset, bytes]")
            out_entries.append((key, at, v))
    except Exception as e:  # noqa: BLE001 - any malformed checkpoint is one refusal with its reason
        raise JournalError(f"malformed journal checkpoint ({type(e).__name__}: {e})"[:200], reason="checkpoint") from e
    return offset, out_leases, out_entries


class Checkpoints:
    """Writer and reader of `<journal>.checkpoints` for one producer process."""

    def __init__(self, kafka: KafkaSettings, topic: str):
        self.kafka, self.topic = kafka, topic
        self._producer = None

    def newest(self, timeout_s: float = 30.0) -> bytes | None:
        """The last checkpoint written (None: none, or not read within `timeout_s`)."""
        from kafka import TopicPartition

        consumer = make_consumer(self.kafka, max_partition_fetch_bytes=self.kafka.max_message_bytes + (1 << 20))
        try:
            tp = TopicPartition(self.topic, 0)
            consumer.assign([tp])
            end = consumer.end_offsets([tp]).get(tp, 0)
            if not end:
                return None
            consumer.seek(tp, end - 1)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                for messages in consumer.poll(timeout_ms=200, max_records=1).values():
                    if messages:
                        return messages[-1].value
            log.warning("journal checkpoint at %s/0/%d not read within %.0f s: reading the journal from its start",
                        self.topic, end - 1, timeout_s)
            return None
        finally:
            consumer.close()

    def write(self, value: bytes) -> None:
        """Send a checkpoint (not waited for: a lost one only makes the next start read longer)."""
        if self._producer is None:
            self._producer = make_producer(self.kafka, "control", max_request_size=self.kafka.max_message_bytes)
        self._producer.send(self.topic, key=b"checkpoint", value=value)

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=5)
            except Exception as e:  # noqa: BLE001 - closing is best effort
                log.debug("journal checkpoint producer close: %s", e)
