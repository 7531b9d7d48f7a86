"""The cost of asynchrony per loss, and whether `max_staleness: auto` earns its keep (tiny model, CPU).
Prints one JSON object last.

    .venv/bin/python tests/bench/stability.py [--versions 120] [--seconds 300] [--losses minirl,dppo_tv] [--seeds 0]
                                              [--set k=v ...] [--smoke]

Runs arms of `rlstream experiment stability` (ops/harness/stability.py; replay none, B = 4
groups, N = 2 mini-batches): for each loss, max_staleness 0, 2, 8 and auto (limits 0..8, start 2), each
for `--versions` optimizer steps (at most `--seconds` of RL), from the same warm start; with
several `--seeds` each figure is the mean over seeds. Per loss:
  k8_over_k0_accuracy      held-out accuracy after the budget at max_staleness 8 / at 0
                           (the cost of asynchrony: 1.0 = none)
  best_fixed               the fixed bound with the best accuracy
  auto_over_best_accuracy  auto's accuracy / the best fixed bound's   (goal >= 0.95)
  auto_over_best_throughput auto's trained samples/s / the best fixed bound's (goal >= 1.0)
  auto_goal_met            both goals
`targets_met`: the auto goal met for every loss.

`--smoke`: minirl's auto arm alone for 5 s (one engine start) after a one-step SFT, batches of
4 groups, in a temporary directory: no ratio (null), the stages run.

`--from-json FILE`: no run; the same figures from the last JSON line of a finished
`rlstream experiment stability` (its `main:*-none-*` arms are these arms), e.g. over its 3 seeds.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlstream.common.config import load_config  # noqa: E402
from rlstream.harness.experiments import experiment_result  # noqa: E402
from rlstream.harness.stability import BOUNDS, main_arm  # noqa: E402
from tests.bench._smoke import experiment_overrides, parse_args  # noqa: E402

SMOKE = dict(seconds=5.0, losses="minirl", seeds="0", bounds="auto")
FIXED = tuple(b for b in BOUNDS if b != "auto")


def _mean(vals):
    vals = [v for v in vals if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def per_loss(arms: dict, loss: str, seeds: list[int], bounds: list[str]) -> dict:
    acc = {b: _mean([arms.get(main_arm(loss, "none", b, s)[0], {}).get("heldout_accuracy") for s in seeds])
           for b in bounds}
    sps = {b: _mean([arms.get(main_arm(loss, "none", b, s)[0], {}).get("samples_per_s") for s in seeds])
           for b in bounds}
    fixed = [b for b in FIXED if acc.get(b) is not None]
    best = max(fixed, key=lambda b: acc[b]) if fixed else None
    out = {"accuracy": acc, "samples_per_s": sps, "best_fixed": best,
           "k8_over_k0_accuracy": _ratio(acc.get("k8"), acc.get("k0")),
           "auto_over_best_accuracy": _ratio(acc.get("auto"), acc.get(best)),
           "auto_over_best_throughput": _ratio(sps.get("auto"), sps.get(best))}
    a, t = out["auto_over_best_accuracy"], out["auto_over_best_throughput"]
    out["auto_goal_met"] = None if a is None or t is None else (a >= 0.95 and t >= 1.0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"))
    p.add_argument("--versions", type=int, default=None, help="policy versions per arm (default: the experiment's, 120)")
    p.add_argument("--seconds", type=float, default=None, help="RL seconds per arm at most (default 300)")
    p.add_argument("--losses", default="minirl,dppo_tv")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (each arm once per seed)")
    p.add_argument("--bounds", default=",".join(BOUNDS), help="subset of k0,k2,k8,auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--from-json", help="figures from a finished `rlstream experiment stability` run's JSON")
    a = parse_args(p, SMOKE)
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    losses, seeds, bounds = a.losses.split(","), [int(s) for s in a.seeds.split(",")], a.bounds.split(",")
    names = [main_arm(loss, "none", b, s)[0] for s in seeds for loss in losses for b in bounds]
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text().strip().splitlines()[-1])
    else:
        res = run(a, names)
    arms = {n: m for n, m in res["arms"].items() if n in names}
    out = {"losses": {loss: per_loss(res["arms"], loss, seeds, bounds) for loss in losses},
           "arms": {n: {k: m.get(k) for k in ("heldout_accuracy", "samples_per_s", "bound", "bound_final", "ess",
                                              "mismatch_kl", "collapsed_by_accuracy", "ok")}
                    for n, m in arms.items()},
           "warm_accuracy": res["warm_accuracy"], "arm_seconds": res["arm_seconds"],
           "arm_versions": res["arm_versions"], "seeds": seeds,
           "smoke": a.smoke}
    goals = [v["auto_goal_met"] for v in out["losses"].values()]
    out["targets_met"] = None if None in goals else all(goals)
    print(json.dumps(out), flush=True)
    return 0 if all(m["ok"] for m in arms.values()) else 1


def run(a: argparse.Namespace, names: list[str]) -> dict:
    """The arms `names` of the stability experiment: its JSON object."""
    with tempfile.TemporaryDirectory(prefix="rlstream-smoke-") as work:  # used by --smoke only
        arms = ",".join(names)
        overrides = experiment_overrides(work, arms) if a.smoke else [f"experiment.arms={arms}"]
        versions = [f"experiment.arm_versions={a.versions}"] if a.versions else []
        cfg = load_config(a.config, overrides + versions + a.set)  # the user's --set wins
        return experiment_result("stability", cfg, seconds=a.seconds, reps=1)


if __name__ == "__main__":
    raise SystemExit(main())
