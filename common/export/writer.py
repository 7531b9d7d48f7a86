"""Part files and the cursor that makes an export resumable.

    <out>/part-00000.parquet, part-00001.parquet, ...   committed parts (rename after close + fsync)
    <out>/.part-00002.parquet.tmp                      the part being written (deleted on resume)
    <out>/_export.json                                 the cursor: {schema, topic, next: {partition: offset},
                                                       parts, rows, bytes}, rewritten atomically after each part
    <out>/_rejects.jsonl                               records that could not be exported, with the reason

A part is committed first, the cursor after it, each by an atomic rename: a
run that stops anywhere leaves either the cursor of the parts on disk, or
(stopped between the two renames) one committed part beyond it, which a
resume finds by name and removes before it re-exports those records. So a
resumed export has every record once. Memory: the row group being filled
(`row_group_bytes` of record arrays) and at most one being converted and
written in a background thread; a part rolls over at `part_bytes`.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from rlstream.common.export import ExportError
from rlstream.common.export.schema import (
    DICTIONARY_COLUMNS,
    EXPORT_SCHEMA_VERSION,
    SCHEMA,
    STATISTICS_COLUMNS,
    RowBuffer,
)
from rlstream.common.fsutil import fsync_path

CURSOR = "_export.json"
REJECTS = "_rejects.jsonl"


@dataclass
class Cursor:
    topic: str
    next: dict[int, int] = field(default_factory=dict)
    """partition -> the first offset not in a committed part."""
    parts: int = 0
    rows: int = 0
    bytes: int = 0
    schema: int = EXPORT_SCHEMA_VERSION

    @classmethod
    def load(cls, out: Path) -> "Cursor | None":
        path = Path(out) / CURSOR
        if not path.is_file():
            return None
        d = json.loads(path.read_text())
        if d.get("schema") != EXPORT_SCHEMA_VERSION:
            raise ExportError(f"{path} is of export schema {d.get('schema')!r}, this rlstream writes "
                              f"{EXPORT_SCHEMA_VERSION}: continue it with the rlstream that started it, "
                              "or export into a new --out")
        d["next"] = {int(p): int(o) for p, o in d["next"].items()}
        return cls(**d)

    def save(self, out: Path) -> None:
        tmp = Path(out) / f".{CURSOR}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        fsync_path(tmp)
        os.replace(tmp, Path(out) / CURSOR)
        fsync_path(Path(out))


class PartWriter:
    """Rows in, row groups and part files out; `commit` ends the part at a cursor."""

    def __init__(self, out: Path, cursor: Cursor, row_group_bytes: int, part_bytes: int, compression: str):
        self.out, self.cursor = Path(out), cursor
        self.row_group_bytes, self.part_bytes, self.compression = row_group_bytes, part_bytes, compression
        self.rows = RowBuffer()
        self._writes = _OneWrite()
        self._writer: pq.ParquetWriter | None = None
        self._part_bytes = 0
        self._part_rows = 0
        self._clean()

    def _clean(self) -> None:
        """Remove what a stopped run left beyond its cursor: a part being written, a committed
        part whose cursor was never written."""
        for p in self.out.glob(".part-*.parquet.tmp"):
            p.unlink()
        for p in self.out.glob("part-*.parquet"):
            if int(p.stem.split("-")[1]) >= self.cursor.parts:
                p.unlink()

    def _path(self, tmp: bool) -> Path:
        name = f"part-{self.cursor.parts:05d}.parquet"
        return self.out / (f".{name}.tmp" if tmp else name)

    def add(self, r, partition: int, offset: int, timestamp_ms: int, claim: str | None) -> None:
        self.rows.add(r, partition, offset, timestamp_ms, claim)
        if self.rows.nbytes >= self.row_group_bytes:
            self.flush()

    def flush(self) -> None:
        """The buffered rows become one row group of the current part, written in the
        background (Arrow conversion and compression overlap the next rows' reads); at
        most one row group is in flight."""
        if not len(self.rows):
            return
        rows, self.rows = self.rows, RowBuffer()
        self._part_bytes += rows.nbytes
        self._part_rows += len(rows)
        self.cursor.bytes += rows.nbytes
        self._writes.start(lambda: self._write(rows))

    def _write(self, rows: RowBuffer) -> None:
        table = rows.table()
        if self._writer is None:
            meta = {b"rlstream.export_schema": str(EXPORT_SCHEMA_VERSION).encode(),
                    b"rlstream.topic": self.cursor.topic.encode()}
            self._writer = pq.ParquetWriter(self._path(tmp=True), SCHEMA.with_metadata(meta),
                                            compression=self.compression, use_dictionary=DICTIONARY_COLUMNS,
                                            write_statistics=STATISTICS_COLUMNS)
        self._writer.write_table(table, row_group_size=len(table))

    @property
    def part_full(self) -> bool:
        return self._part_bytes + self.rows.nbytes >= self.part_bytes

    def commit(self, next_offsets: dict[int, int]) -> None:
        """End the part (rows up to `next_offsets`, exclusive), then move the cursor there."""
        self.flush()
        self._writes.wait()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            tmp = self._path(tmp=True)
            fsync_path(tmp)
            os.replace(tmp, self._path(tmp=False))
            self.cursor.parts += 1
            self.cursor.rows += self._part_rows
            self._part_bytes = self._part_rows = 0
        self.cursor.next.update(next_offsets)
        self.cursor.save(self.out)

    def reject(self, partition: int, offset: int, reason: str) -> None:
        with open(self.out / REJECTS, "a") as f:
            f.write(json.dumps({"topic": self.cursor.topic, "partition": partition, "offset": offset,
                                "reason": reason}) + "\n")

    def abort(self) -> None:
        """Drop the part in progress (its records stay beyond the cursor)."""
        try:
            self._writes.wait()
        except Exception:  # noqa: BLE001 - the part is dropped anyway; the caller raises its own error
            pass
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._path(tmp=True).unlink(missing_ok=True)


class _OneWrite:
    """At most one row group being written, in a thread; its error is raised by the next `wait`."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - raised by wait() in the export's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="export-write", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise ExportError(f"writing a row group failed ({type(err).__name__}: {err}); the cursor is "
                              "unchanged: run again to continue") from err
