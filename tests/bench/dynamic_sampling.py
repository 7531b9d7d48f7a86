"""Dynamic sampling on vs off on the demo's task (tiny model, CPU). Prints one JSON object last.

    .venv/bin/python tests/bench/dynamic_sampling.py [--seconds 480] [--reps 1] [--set key=value ...] [--smoke]

`--smoke`: the arm "with" alone (one engine start) for 5 s after a one-step SFT (nearly every
group is filtered), batches of 4 groups, in a temporary directory; no "without" arm, so no speedup.

Runs `rlstream experiment dynamic_sampling` (ops/harness/experiments.py): the same
warm start, task and seeds with `consumer.dynamic_sampling` on (groups whose G
rewards are all equal are filtered at the gate and the batch is filled from the
stream) and off. Each arm is a full pipeline (broker, vLLM producer, Megatron
consumer as processes) until held-out accuracy reaches warm + demo.target_gain
on two evaluations in a row, or `--seconds`. With `--reps 2` the arms run with,
without, without, with (ABBA) and combine their repetitions.
  dynamic_sampling_speedup        seconds to target without / with (null: an arm missed it)
  dynamic_sampling_speedup_each   per ABBA pair
  {with,without}_seconds_to_target, _trained_to_target, _generated_to_target
  trained_to_target_ratio         samples trained to the target, without / with
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
    p.add_argument("--seconds", type=float, default=None, help="RL seconds per arm at most (default 480)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per arm, interleaved ABBA (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = parse_args(p, SMOKE)
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="rlstream-smoke-") as work:  # used by --smoke only
        overrides = experiment_overrides(work, "with") + a.set if a.smoke else a.set  # the user's --set wins
        return run_experiment("dynamic_sampling", load_config(a.config, overrides), seconds=a.seconds, reps=a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
