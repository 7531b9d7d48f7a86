"""`rlstream experiment async|objectives|replay`: short side-by-side runs.

    rlstream experiment async      -c configs/tiny-cpu.yaml
    rlstream experiment objectives -c configs/tiny-cpu.yaml
    rlstream experiment replay     -c configs/tiny-cpu.yaml

Every arm is one full pipeline run (`common.demo.run_rl`: fresh broker,
producer(s), consumer, run directory) from the same SFT warm start (shared and
cached, `common.demo.prepare_warm`), the same task and seeds; arms differ only
in the overrides listed below. Arms run one after another (2 cores).

- async: synchronous (`staleness.max_staleness=0`: the producers admit one
  batch per version, so generation and training alternate) vs asynchronous
  (`max_staleness` = k, the config's value or 2). Each arm runs until held-out
  accuracy reaches warm + `demo.target_gain` (two evaluations in a row) or
  `ARM_SECONDS["async"]`. Prints a table and one JSON object with
  `async_speedup` = async trained samples/s / sync trained samples/s and each
  arm's wall time to the target accuracy.
- objectives: `consumer.loss` = minirl, minirl_no_is, grpo, cispo, on-policy.
- replay: `consumer.num_minibatches=4` (off-policy, 4 updates per batch) with
  routing replay none / R2 / R3, each with the PPO-style clipping mask and
  without it (eps_low = eps_high = 1e6: no token is ever masked), plus R3 with
  bf16 inference (`producer.engine.dtype=bfloat16`) against fp32 training.

Per arm: reward (last quarter), held-out accuracy (final, greedy), training-
inference KL and clip fraction (means over the last quarter), entropy, and
`collapsed`: final held-out accuracy more than `COLLAPSE_ACC_DROP` below the
warm start, or mean training-inference KL over the last quarter above
`COLLAPSE_KL`. These are short runs (minutes, not the paper's days): they
show the mechanics and the direction of effects, not the paper's numbers.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from common.config import RlstreamConfig
from common.errors import ConfigError

log = logging.getLogger("rlstream.experiments")

COLLAPSE_ACC_DROP = 0.10
COLLAPSE_KL = 0.05
ARM_SECONDS = {"async": 240.0, "objectives": 120.0, "replay": 120.0}
NO_CLIP = {"consumer.eps_low": 1e6, "consumer.eps_high": 1e6}


@dataclass
class Arm:
    name: str
    overrides: dict[str, Any]


def arms(name: str, cfg: RlstreamConfig) -> list[Arm]:
    if name == "async":
        k = cfg.staleness.max_staleness or 2
        return [Arm("sync", {"staleness.max_staleness": 0}), Arm(f"async_k{k}", {"staleness.max_staleness": k})]
    if name == "objectives":
        return [Arm(loss, {"consumer.loss": loss, "consumer.num_minibatches": 1})
                for loss in ("minirl", "minirl_no_is", "grpo", "cispo")]
    if name == "replay":
        base = {"consumer.num_minibatches": 4}
        out = []
        for replay in ("none", "R2", "R3"):
            out.append(Arm(f"{replay}_clip", {**base, "consumer.replay": replay}))
            out.append(Arm(f"{replay}_noclip", {**base, "consumer.replay": replay, **NO_CLIP}))
        out.append(Arm("R3_clip_bf16_inference", {**base, "consumer.replay": "R3",
                                                  "producer.engine.dtype": "bfloat16"}))
        return out
    raise ConfigError(f"unknown experiment {name!r}; choose async, objectives or replay")


def _last_quarter(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get("kind") == "tick" and r.get(key) is not None]
    if not vals:
        return None
    tail = vals[-max(1, len(vals) // 4):]
    return sum(tail) / len(tail)


def arm_metrics(res) -> dict:
    """One row of the experiment table from a `RunResult`."""
    kl = _last_quarter(res.rows, "kl")
    collapsed = ((res.final_accuracy is not None and res.final_accuracy < res.warm_accuracy - COLLAPSE_ACC_DROP)
                 or (kl is not None and kl > COLLAPSE_KL))
    return {
        "reward": _last_quarter(res.rows, "reward_mean"), "heldout_accuracy": res.final_accuracy,
        "best_accuracy": res.best_accuracy, "kl": kl, "clip_frac": _last_quarter(res.rows, "clip_frac"),
        "entropy": _last_quarter(res.rows, "entropy"), "collapsed": bool(collapsed),
        "samples_per_s": res.samples_per_s, "versions": res.versions, "rl_seconds": res.rl_seconds,
        "seconds_to_target": res.seconds_to_target, "ok": res.ok, "error": res.error,
        "run_dir": res.run_dir,
    }


def _table(rows: dict[str, dict]) -> str:
    cols = ("reward", "heldout_accuracy", "kl", "clip_frac", "entropy", "samples_per_s", "versions",
            "seconds_to_target", "collapsed", "ok")
    fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {arm} | " + " | ".join(fmt(m[c]) for c in cols) + " |" for arm, m in rows.items()]
    return "\n".join(lines)


def run_experiment(name: str, cfg: RlstreamConfig, seconds: float | None = None) -> int:
    """Run every arm of `name`; print the table and one JSON line; 0 iff every arm ran cleanly."""
    from common.demo import StopRule, prepare_warm, run_rl, say

    arm_list = arms(name, cfg)
    warm = prepare_warm(cfg)
    target = min(1.0, warm.accuracy + cfg.demo.target_gain)
    budget = seconds or ARM_SECONDS[name]
    say(f"experiment {name}: {len(arm_list)} arms x <= {budget:.0f} s, warm accuracy {warm.accuracy:.3f}, "
        f"target {target:.3f}")
    results: dict[str, dict] = {}
    for arm in arm_list:
        stop = StopRule(target_accuracy=target if name == "async" else None, max_seconds=budget)
        res = run_rl(cfg, warm, f"{name}-{arm.name}", stop, overrides=arm.overrides,
                     eval_every_s=15.0 if name == "async" else 30.0)
        results[arm.name] = {**arm_metrics(res), "overrides": arm.overrides}
    say(_table(results))
    out: dict[str, Any] = {"experiment": name, "warm_accuracy": warm.accuracy, "target_accuracy": target,
                           "arm_seconds": budget, "arms": results}
    if name == "async":
        sync, asyn = results["sync"], next(v for k, v in results.items() if k != "sync")
        out["async_speedup"] = (asyn["samples_per_s"] / sync["samples_per_s"]) if sync["samples_per_s"] else None
        out["sync_seconds_to_target"] = sync["seconds_to_target"]
        out["async_seconds_to_target"] = asyn["seconds_to_target"]
    print(json.dumps(out, default=str), flush=True)
    return 0 if all(r["ok"] for r in results.values()) else 1
