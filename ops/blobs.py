"""`rlstream blobs gc`: the claim-check blob store's garbage collector as a command.

The collection is common/kafka/blobgc.py (the runtime); this module adds what only
the tooling above the roles may name: the consumer's checkpoints, for
`--keep-from-checkpoints` (consumer/logreplay/lineage.py `resume_floors`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import ConfigError
from rlstream.common.kafka.blobgc import collect
from rlstream.common.kafka.claimcheck import open_blob_store
from rlstream.common.kafka.scan import require_broker
from rlstream.consumer.logreplay.lineage import resume_floors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["gc"])
    p.add_argument("--min-age-s", type=float, default=86400.0,
                   help="keep blobs younger than this, whatever the topics say (default one day)")
    p.add_argument("--keep-from-checkpoints", action="append", type=Path, default=[], metavar="DIR",
                   help="a consumer's checkpoint_dir: rollouts below its oldest checkpoint's offsets lose their blobs")
    p.add_argument("--topic", action="append", default=[],
                   help="another topic whose pointers keep their blobs (a store several deployments share)")
    p.add_argument("--report-only", action="store_true", help="report what would be deleted, delete nothing")


def main(cfg: RlstreamConfig, args: argparse.Namespace) -> int:
    """Prints the report (one JSON line)."""
    require_broker(cfg.kafka, "blobs gc")
    if args.min_age_s < 0:
        raise ConfigError("must be >= 0", key="--min-age-s")
    topics = [cfg.kafka.topics.rollouts, cfg.kafka.topics.dlq, *args.topic]
    floors = {}
    if args.keep_from_checkpoints:
        floors[cfg.kafka.topics.rollouts] = resume_floors(args.keep_from_checkpoints)
    report = collect(open_blob_store(cfg.kafka.blob_dir), cfg.kafka, topics, floors, args.min_age_s,
                     args.report_only)
    print(json.dumps(asdict(report)), flush=True)
    return 0
