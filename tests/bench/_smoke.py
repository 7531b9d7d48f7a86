"""`--smoke` for every benchmark: the smallest case, so that CI runs each bench and none rots.

    args = parse_args(ap, SMOKE)   # SMOKE: {dest: value}, the bench's knobs at their smallest

With `--smoke` the bench's knobs default to `SMOKE` instead of their full-size
values; a flag given on the command line still wins (`--smoke --reps 2`). The
result has `smoke=True` so its JSON can say so: smoke figures are noisy and
measure nothing (tests/integration/test_bench_smoke.py runs every bench this way).
Not a benchmark itself (the leading underscore keeps it out of that list).
"""
from __future__ import annotations

import argparse

HELP = "smallest case (seconds to a minute on 2 cores): checks the bench runs; its figures mean nothing"


def parse_args(ap: argparse.ArgumentParser, smoke: dict, argv=None) -> argparse.Namespace:
    """Parse `argv` with `--smoke` added; under it, `smoke` replaces the defaults."""
    ap.add_argument("--smoke", action="store_true", help=HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**smoke)
        args = ap.parse_args(argv)  # again, so explicit flags win over the smoke defaults
    return args


def experiment_overrides(work, arm: str) -> list[str]:
    """`--set` overrides of an `rlstream experiment` bench's smoke run: one arm (one
    vLLM engine start), everything under `work`, small batches, greedy held-out
    scoring (8x fewer generations than avg@8) and a one-step SFT warm start: far
    below its band (the run warns), so rewards are mostly 0 and the figures
    mean nothing, but every stage of the experiment runs."""
    return [f"experiment.arms={arm}", f"model.path={work}/tiny-model", f"producer.prompts.path={work}/data/train.jsonl",
            f"demo.work_dir={work}/demo", f"kafka.blob_dir={work}/blobs", "demo.sft_max_steps=1",
            "demo.eval_metric=greedy", "consumer.groups_per_batch=4"]
