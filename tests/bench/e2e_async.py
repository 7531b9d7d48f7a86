"""Synchronous vs asynchronous pipeline on the tiny model (CPU). Prints one JSON object last.

    .venv/bin/python tests/bench/e2e_async.py [--seconds 240] [--reps 2] [--set key=value ...]

Runs `rlstream experiment async` (common/harness/experiments.py): the same warm start,
task and seeds with `staleness.max_staleness=0` (one batch per version:
generation and training alternate) and with max_staleness k. Each arm is a
full pipeline (broker, vLLM producer, Megatron consumer as processes) until
held-out accuracy reaches warm + demo.target_gain or `--seconds`. With
`--reps 2` (the default) the arms run sync, async, async, sync (ABBA: cancels
a linear drift of the shared machine's load) and combine their repetitions.
  async_speedup            async trained samples/s / sync trained samples/s
  async_speedup_each       per ABBA pair
  *_seconds_to_target      wall seconds of RL until the target (null: not reached)
  arms.*.phases            where a global step's time went (consumer wait/train/checkpoint/
                           publish, producer engine seconds per step, engine busy fraction)
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.config import load_config  # noqa: E402
from common.harness.experiments import run_experiment  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"))
    p.add_argument("--seconds", type=float, default=None, help="RL seconds per arm (default: the experiment's)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per arm, interleaved ABBA (default 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    return run_experiment("async", load_config(a.config, a.set), seconds=a.seconds, reps=a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
