"""`rlstream replay` arguments and entry (ops/cli.py registers it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlstream.common.config import RlstreamConfig
from rlstream.common.kafka.scan import require_broker
from rlstream.consumer.logreplay.run import replay


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path,
                   help="directory for the replayed checkpoint and replay.jsonl (never the run's)")
    p.add_argument("--run-dir", type=Path, help="the run's checkpoint directory (default: consumer.checkpoint_dir)")
    p.add_argument("--from", dest="start", type=Path,
                   help="start at this checkpoint (a step-NNNNNNNN directory) instead of step 0 (model.path)")
    p.add_argument("--to-step", type=int, help="last step to replay (default: the newest checkpoint's)")
    p.add_argument("--allow-settings-change", action="store_true",
                   help="train the run's records under this config's trainer settings (an ablation)")
    p.add_argument("--no-compare", action="store_true", help="skip the parameter comparison at the end")


def main(cfg: RlstreamConfig, args: argparse.Namespace) -> int:
    """Prints the summary (one JSON line); exit 0 when the replay equals the original, 1 when not."""
    require_broker(cfg.kafka, "replay")
    summary = replay(cfg, args.out, args.run_dir, args.start, args.to_step, args.allow_settings_change,
                     not args.no_compare)
    print(json.dumps(summary.as_dict()), flush=True)
    return 0 if summary.equal else 1
