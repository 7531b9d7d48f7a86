"""`rlstream export` arguments and entry (ops/cli.py registers it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import ConfigError
from rlstream.common.kafka.scan import require_broker


def _offsets(text: str) -> dict[int, int]:
    """`0:120,1:98` -> {0: 120, 1: 98}."""
    try:
        return {int(p): int(o) for p, o in (x.split(":") for x in text.split(",") if x.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PARTITION:OFFSET[,PARTITION:OFFSET...]") from None


def _start(text: str) -> dict[int, int] | str:
    return text if text == "earliest" else _offsets(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="directory of the Parquet parts and the cursor")
    p.add_argument("--topic", help="topic to export (default: kafka.topics.rollouts)")
    p.add_argument("--start", type=_start, help="earliest, or PARTITION:OFFSET,... (a new --out only; default: the log start)")
    p.add_argument("--end", type=_offsets, help="PARTITION:OFFSET,... exclusive (default: the topic's end)")
    p.add_argument("--group", help="start from this consumer group's committed offsets and commit them as it goes")
    p.add_argument("--max-records", type=int, help="stop after this many records (a later run continues)")
    p.add_argument("--row-group-mb", type=int, default=64, help="record bytes per row group (memory bound)")
    p.add_argument("--part-mb", type=int, default=1024, help="record bytes per part file")
    p.add_argument("--compression", default="snappy", choices=["snappy", "zstd", "lz4", "gzip", "none"],
                   help="Parquet compression (default snappy: zstd writes ~15%% smaller files at half the speed)")


def main(cfg: RlstreamConfig, args: argparse.Namespace) -> int:
    """Prints the summary (one JSON line)."""
    from rlstream.common.export.run import ExportOptions, export  # defers pyarrow

    require_broker(cfg.kafka, "export")
    if not 1 <= args.row_group_mb <= 1024:
        raise ConfigError("must be 1..1024 (MB)", key="--row-group-mb")
    if args.part_mb < args.row_group_mb:
        raise ConfigError("must be at least --row-group-mb", key="--part-mb")
    opt = ExportOptions(topic=args.topic, start=args.start, end=args.end, group=args.group, max_records=args.max_records,
                        row_group_bytes=args.row_group_mb << 20, part_bytes=args.part_mb << 20,
                        compression=args.compression)
    summary = export(cfg.kafka, args.out, opt)
    print(json.dumps(summary.as_dict()), flush=True)
    return 0
