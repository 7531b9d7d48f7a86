"""Export a rollouts topic to Parquet: `rlstream export` (docs/log.md, "Export").

    schema.py   the Parquet schema (one row per rollout record; EXPORT_SCHEMA_VERSION in
                every file's metadata) and `RowBuffer`, the rows of one row group as
                columns built from the records' arrays
    writer.py   `PartWriter`: row groups into part files, each committed by rename, and
                the cursor (`_export.json`: the next offset per partition) committed after
                it, so a run that stops anywhere resumes without a duplicate or a gap
    run.py      the export: where to start (the cursor, a consumer group's committed
                offsets, or --start) and end (the topic's end when it started, or
                --end), the read loop, progress, records that cannot be exported
                (`_rejects.jsonl`, with the reason)

pyarrow writes the files; `datasets.load_dataset("parquet", data_files=...)`
reads them (tests/integration/test_export.py).
"""
from rlstream.common.errors import RlstreamError


class ExportError(RlstreamError):
    """An export cannot start or go on (its directory, its cursor, the topic); the message says what to do."""
