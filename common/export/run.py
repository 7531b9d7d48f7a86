"""The export: a rollouts topic, from a start to an end, into Parquet parts.

Where it starts, per partition: the directory's cursor (a second run
continues where the first stopped), else with `group` that consumer group's
committed offset, else `start` (`earliest`, or partition:offset pairs), else
the partition's log start. Where it ends: `end` (partition:offset pairs,
exclusive), capped by and otherwise equal to where the partition ended when
the export first fetched from it, so an export of a topic producers keep
writing finishes. With `group`, the group's offsets are committed after each
part's cursor: other tools see the export's progress as that group's lag, and
an export into a new directory can start from it.

Streaming: the reader's fetches (bounded by kafka.max_message_bytes), one row
group (`row_group_bytes`) and one part's Parquet writer are all it holds;
nothing grows with the topic. Progress goes to the log every `progress_s`.
A record that cannot be exported (undecodable, a claim check whose blob is
gone or fails its check) is not a row: it is listed with its reason in
`_rejects.jsonl` and counted, and the export goes on.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import InvalidRecordError
from rlstream.common.export import ExportError
from rlstream.common.export.writer import Cursor, PartWriter
from rlstream.common.kafka.claimcheck import open_blob_store, resolve
from rlstream.common.kafka.client import make_consumer
from rlstream.common.kafka.scan import TopicScan

log = logging.getLogger("rlstream.export")

STALL_S = 120.0
"""An export that reads nothing for this long while records before its end are due fails (the cursor stays)."""


@dataclass
class ExportOptions:
    topic: str | None = None
    start: dict[int, int] | str | None = None
    """`earliest` or {partition: offset}; only for a new directory."""
    end: dict[int, int] | None = None
    group: str | None = None
    max_records: int | None = None
    row_group_bytes: int = 64 << 20
    part_bytes: int = 1 << 30
    compression: str = "snappy"
    progress_s: float = 5.0


@dataclass
class ExportSummary:
    records: int = 0
    rejected: int = 0
    bytes: int = 0
    """Record array bytes written (tokens, log-probs, masks, versions, routing)."""
    value_bytes: int = 0
    """Kafka value bytes read (what a raw decode of the same records reads)."""
    seconds: float = 0.0
    parts: int = 0
    next: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"records": self.records, "rejected": self.rejected, "bytes": self.bytes,
                "value_bytes": self.value_bytes, "seconds": round(self.seconds, 3),
                "value_mb_per_s": round(self.value_bytes / 1e6 / max(self.seconds, 1e-9), 2),
                "parts": self.parts, "next": {str(p): o for p, o in sorted(self.next.items())}}


def export(kafka: KafkaSettings, out: Path, opt: ExportOptions) -> ExportSummary:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cursor = Cursor.load(out)
    topic = opt.topic or (cursor.topic if cursor else kafka.topics.rollouts)
    if cursor is not None and cursor.topic != topic:
        raise ExportError(f"{out} holds an export of topic {cursor.topic}, not {topic}: use another --out")
    if cursor is not None and opt.start is not None:
        raise ExportError(f"{out} holds an export in progress (next offsets {cursor.next}): run without "
                          "--start to continue it, or export into a new --out")
    with TopicScan(kafka, topic) as scan, _Group(kafka, topic, opt.group, scan.partitions) as group:
        begin = _begin(cursor, opt.start, group.committed(), scan.log_starts())
        writer = PartWriter(out, cursor or Cursor(topic, dict(begin)), opt.row_group_bytes, opt.part_bytes,
                            opt.compression)
        scan.seek(begin)
        try:
            summary = _copy(scan, writer, group, dict(begin), opt, open_blob_store(kafka.blob_dir))
        except BaseException:
            writer.abort()  # its records stay beyond the cursor: the next run exports them
            raise
    summary.parts = writer.cursor.parts
    return summary


def _begin(cursor: Cursor | None, start, committed: dict[int, int], log_starts: dict[int, int]) -> dict[int, int]:
    begin = {}
    for p, first in log_starts.items():
        if cursor is not None and p in cursor.next:
            begin[p] = cursor.next[p]
        elif p in committed:
            begin[p] = committed[p]
        elif isinstance(start, dict) and p in start:
            begin[p] = start[p]
        else:
            begin[p] = first
        if begin[p] < first:
            raise ExportError(f"partition {p} starts at offset {first} now (retention deleted what was before), "
                              f"but the export would start at {begin[p]}: records {begin[p]}..{first - 1} are gone; "
                              f"pass --start {p}:{first} in a new --out to export what remains")
    return begin


def _copy(scan: TopicScan, writer: PartWriter, group: "_Group", position: dict[int, int], opt: ExportOptions,
          blobs) -> ExportSummary:
    s = ExportSummary()
    t0 = last_log = last_progress = time.perf_counter()

    def full() -> bool:
        return opt.max_records is not None and s.records + s.rejected >= opt.max_records

    while True:
        end = {p: min((opt.end or {}).get(p, math.inf), scan.end(p) if scan.end(p) is not None else math.inf)
               for p in scan.partitions}
        active = {p for p in scan.partitions if scan.end(p) is None or position[p] < end[p]}
        if not active or full():
            break
        msgs = scan.poll(only=active)
        for m in msgs:
            if m.offset >= end[m.partition] or full():
                continue
            _one(m, writer, blobs, s)
            position[m.partition] = m.offset + 1
            if writer.part_full:
                _commit(writer, group, position)
        if not full():  # past gaps in the offsets (transaction markers): the scan's position, within the end
            for p in active:
                if scan.end(p) is not None:
                    position[p] = max(position[p], min(scan.position(p), end[p]))
        now = time.perf_counter()
        last_progress = now if msgs else last_progress
        if now - last_progress > STALL_S:
            raise ExportError(f"no record from partitions {sorted(active)} of {scan.topic} for {STALL_S:.0f} s "
                              f"before their end {[end[p] for p in sorted(active)]}; is the broker reachable?")
        if now - last_log >= opt.progress_s:
            last_log = now
            _progress(s, now - t0, scan, position)
    _commit(writer, group, position)
    s.seconds = time.perf_counter() - t0
    s.next = dict(writer.cursor.next)
    _progress(s, s.seconds, scan, position)
    return s


def _one(m, writer: PartWriter, blobs, s: ExportSummary) -> None:
    s.value_bytes += len(m.value or b"")
    try:
        r, pointer = resolve(m.value, blobs)
    except InvalidRecordError as e:
        writer.reject(m.partition, m.offset, str(e))
        s.rejected += 1
        log.warning("record %s/%d/%d not exported: %s", m.topic, m.partition, m.offset, e)
        return
    before = writer.cursor.bytes + writer.rows.nbytes
    writer.add(r, m.partition, m.offset, m.timestamp, pointer.sha256 if pointer else None)
    s.bytes += writer.cursor.bytes + writer.rows.nbytes - before
    s.records += 1


def _commit(writer: PartWriter, group: "_Group", position: dict[int, int]) -> None:
    writer.commit(position)
    group.commit(position)


def _progress(s: ExportSummary, seconds: float, scan: TopicScan, position: dict[int, int]) -> None:
    left = sum(max(0, scan.end(p) - position[p]) for p in scan.partitions if scan.end(p) is not None)
    log.info("export: %d records (%.1f MB) in %.1f s, %.1f MB/s, %d rejected, %d records left",
             s.records, s.value_bytes / 1e6, seconds, s.value_bytes / 1e6 / max(seconds, 1e-9), s.rejected, left)


class _Group:
    """A consumer group whose committed offsets follow the export (nothing without `group`)."""

    def __init__(self, kafka: KafkaSettings, topic: str, group: str | None, partitions: list[int]):
        from kafka import TopicPartition

        self._consumer = None if group is None else make_consumer(kafka, group_id=group, enable_auto_commit=False)
        self._tps = {p: TopicPartition(topic, p) for p in partitions}
        self.group = group

    def committed(self) -> dict[int, int]:
        if self._consumer is None:
            return {}
        out = {p: self._consumer.committed(tp) for p, tp in self._tps.items()}
        return {p: int(o) for p, o in out.items() if o is not None}

    def commit(self, position: dict[int, int]) -> None:
        if self._consumer is None:
            return
        from kafka.structs import OffsetAndMetadata

        try:
            self._consumer.commit({self._tps[p]: OffsetAndMetadata(o, "", -1) for p, o in position.items()})
        except Exception as e:
            raise ExportError(f"committing offsets of group {self.group} failed ({type(e).__name__}: {e}); the "
                              "directory's cursor has them: run again to continue") from e

    def __enter__(self) -> "_Group":
        return self

    def __exit__(self, *exc) -> None:
        if self._consumer is not None:
            self._consumer.close()
