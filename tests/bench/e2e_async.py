"""Synchronous vs asynchronous pipeline on the tiny model (CPU). Prints one JSON object last.

    .venv/bin/python tests/bench/e2e_async.py [--seconds 240] [--reps 2] [--set key=value ...] [--smoke]

`--smoke`: the async arm alone (one engine start) for 5 s after a one-step SFT, batches of 4
groups, dynamic sampling off, in a temporary directory; no sync arm, so no `async_speedup`.

Runs `rlstream experiment async` (ops/harness/experiments.py): the same warm start,
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
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlstream.common.config import load_config  # noqa: E402
from rlstream.harness.experiments import run_experiment  # noqa: E402
from tests.bench._smoke import experiment_overrides, parse_args  # noqa: E402

SMOKE = dict(seconds=5.0, reps=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"))
    p.add_argument("--seconds", type=float, default=None, help="RL seconds per arm (default: the experiment's)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per arm, interleaved ABBA (default 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = parse_args(p, SMOKE)
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="rlstream-smoke-") as work:  # used by --smoke only
        # dynamic sampling off: the smoke's warm start scores 0 on every sample, so it would filter every group
        smoke = experiment_overrides(work, "async_k2") + ["consumer.dynamic_sampling=off"]
        overrides = smoke + a.set if a.smoke else a.set  # the user's --set wins
        return run_experiment("async", load_config(a.config, overrides), seconds=a.seconds, reps=a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
