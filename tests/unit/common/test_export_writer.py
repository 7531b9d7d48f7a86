"""The export's parts and cursor (common/export/writer.py), without a broker: a run stopped
anywhere resumes with every record once, and a cursor of another schema is refused."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlstream.common.export import ExportError
from rlstream.common.export.writer import CURSOR, Cursor, PartWriter
from tests.support.synthetic import synthetic_group


def _rows(out) -> list[int]:
    return sorted(o for p in sorted(out.glob("part-*.parquet")) for o in pq.read_table(p)["offset"].to_pylist())


def test_a_part_beyond_the_cursor_and_a_torn_part_are_removed_on_resume(tmp_path):
    records = synthetic_group("g", 6, 0, np.random.default_rng(0))
    w = PartWriter(tmp_path, Cursor("t"), row_group_bytes=1, part_bytes=1 << 30, compression="snappy")
    for i, r in enumerate(records[:3]):
        w.add(r, 0, i, 0, None)
    w.commit({0: 3})
    for i, r in enumerate(records[3:], start=3):  # a second part, renamed into place...
        w.add(r, 0, i, 0, None)
    w.flush()
    w._writes.wait()
    w._writer.close()
    w._path(tmp=True).rename(w._path(tmp=False))  # ...then the run died before its cursor was written
    (tmp_path / ".part-00002.parquet.tmp").write_bytes(b"torn")
    assert _rows(tmp_path) == [0, 1, 2, 3, 4, 5]

    cursor = Cursor.load(tmp_path)
    assert cursor.next == {0: 3} and cursor.parts == 1
    PartWriter(tmp_path, cursor, row_group_bytes=1, part_bytes=1 << 30, compression="snappy")
    assert _rows(tmp_path) == [0, 1, 2]  # records 3.. are beyond the cursor: the next run writes them again
    assert not list(tmp_path.glob(".part-*"))


def test_a_cursor_of_another_export_schema_is_refused(tmp_path):
    (tmp_path / CURSOR).write_text(json.dumps({"topic": "t", "next": {}, "parts": 0, "rows": 0, "bytes": 0,
                                               "schema": 99}))
    with pytest.raises(ExportError, match="export schema 99.*new --out"):
        Cursor.load(tmp_path)
