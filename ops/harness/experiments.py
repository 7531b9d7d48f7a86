"""`rlstream experiment async|objectives|replay|dynamic_sampling|tool_use|stability`: short side-by-side runs.

    rlstream experiment async            -c configs/tiny-cpu.yaml
    rlstream experiment objectives       -c configs/tiny-cpu.yaml
    rlstream experiment replay           -c configs/tiny-cpu.yaml
    rlstream experiment dynamic_sampling -c configs/tiny-cpu.yaml
    rlstream experiment tool_use         -c configs/tiny-calculator.yaml
    rlstream experiment stability        -c configs/tiny-cpu.yaml

Every arm is one full pipeline run (`rlstream.harness.runs.run_rl`: fresh broker,
producer(s), consumer, run directory) from the same SFT warm start (shared and
cached, `rlstream.harness.demo.prepare_warm`), the same task and seeds; arms differ only
in the overrides listed below. Arms run one after another (2 cores).

Settings (`experiment` section, common/config/harness.py; environment
`RLSTREAM__EXPERIMENT__ARMS` etc.): `arms` runs a subset of the arms,
`arm_seconds` and `reps` replace the experiment's defaults (`ARM_SECONDS`,
`REPS`); the `seconds`/`reps` arguments of `run_experiment` win over both.

- async: synchronous (`staleness.max_staleness=0`: the producers admit one
  batch per version, so generation and training alternate) vs asynchronous
  (`max_staleness` = k, the config's value or 2). Each arm runs until held-out
  accuracy reaches warm + `demo.target_gain` (two evaluations in a row) or
  `ARM_SECONDS["async"]`, twice, interleaved sync, async, async, sync (ABBA). Prints a table and one JSON object with
  `async_speedup` = async trained samples/s / sync trained samples/s and each
  arm's wall time to the target accuracy.
- objectives: `consumer.loss.name` = minirl, minirl_no_is, grpo, cispo, dppo_tv, dppo_kl, on-policy.
- replay: `consumer.num_minibatches=4` (off-policy, 4 updates per batch) with
  routing replay none / R2 / R3, each with the PPO-style clipping mask and
  without it (eps_low = 0.999999, eps_high = 1e6: no token is masked), plus R3 with
  bf16 inference (`producer.engine.dtype=bfloat16`) against fp32 training.
- dynamic_sampling: `consumer.dynamic_sampling` on (groups of equal rewards
  filtered at the gate) vs off, on the demo's task, each until held-out
  accuracy reaches warm + `demo.target_gain` (two evaluations in a row) or
  `ARM_SECONDS["dynamic_sampling"]`. Per arm: wall seconds of RL to the target
  and the samples trained (and generated) until then. The JSON adds
  `dynamic_sampling_speedup` = seconds to target without / with (per pair too,
  `dynamic_sampling_speedup_each`, when reps > 1), null when a run missed the
  target; `..._at_least` counts a `without` run that missed it at its RL
  seconds (a lower bound).
- tool_use (needs `producer.episodes`, configs/tiny-calculator.yaml): one arm,
  `rl`, RL on calculator episodes from the warm start taught the call format
  (`prepare_warm`'s second SFT stage), until held-out accuracy WITH the tool
  reaches warm + `demo.target_gain` or `ARM_SECONDS["tool_use"]`. The JSON adds
  `before_rl` / `after_rl`: held-out accuracy with the tool (avg@8, greedy) and
  without it (single-turn, same prompts), the tool-call rate, and the gains
  (ops/harness/tool_use.py, which also writes `tool_use.md` in the run dir).

- stability (ops/harness/stability.py): MiniRL vs DPPO, routing replay none / R3,
  max_staleness 0 / 2 / 8 / auto, 3 seeds each, then a sweep of a controlled
  training-inference mismatch; tables of mean and spread over seeds and plots
  (written under `<demo.work_dir>/stability/`). The JSON adds `groups`,
  `table_main`, `table_mismatch`, `table_by_staleness` and `plots`.

Per arm: reward (last quarter), held-out accuracy (final, the demo's metric: avg@8), training-
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

from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import ConfigError
from rlstream.harness.arms import ARM_SECONDS, ARM_VERSIONS, arm_metrics
from rlstream.harness.demo import prepare_warm
from rlstream.harness.runs import StopRule, run_rl, say
from rlstream.harness.stability import arm_specs, stability_metrics, stability_summary
from rlstream.harness.tool_use import require_episodes, tool_use_summary

log = logging.getLogger("rlstream.experiments")

REPS = {"async": 2, "objectives": 1, "replay": 1, "dynamic_sampling": 1, "tool_use": 1, "stability": 1}
TO_TARGET = ("async", "dynamic_sampling", "tool_use")
"""Experiments whose arms stop at the demo's target accuracy (the others run their time)."""
# Overrides every arm of an experiment shares (the workload), before the arm's own.
COMMON: dict[str, dict[str, Any]] = {}
# No PPO-style mask: r < 1 - eps_low or r > 1 + eps_high never happens in 4
# mini-batches (eps_low must stay below 1: the trainer refuses 1 - eps_low <= 0).
NO_CLIP = {"consumer.loss.eps_low": 0.999999, "consumer.loss.eps_high": 1e6}


@dataclass
class Arm:
    name: str
    overrides: dict[str, Any]


def arms(name: str, cfg: RlstreamConfig) -> list[Arm]:
    if name == "async":
        k = cfg.staleness.max_staleness or 2
        return [Arm("sync", {"staleness.max_staleness": 0}), Arm(f"async_k{k}", {"staleness.max_staleness": k})]
    if name == "objectives":
        return [Arm(loss, {"consumer.loss.name": loss, "consumer.num_minibatches": 1})
                for loss in ("minirl", "minirl_no_is", "grpo", "cispo", "dppo_tv", "dppo_kl")]
    if name == "replay":
        base = {"consumer.num_minibatches": 4}
        out = []
        for replay in ("none", "R2", "R3"):
            out.append(Arm(f"{replay}_clip", {**base, "consumer.replay": replay}))
            out.append(Arm(f"{replay}_noclip", {**base, "consumer.replay": replay, **NO_CLIP}))
        out.append(Arm("R3_clip_bf16_inference", {**base, "consumer.replay": "R3",
                                                  "producer.engine.dtype": "bfloat16"}))
        return out
    if name == "dynamic_sampling":
        return [Arm("with", {"consumer.dynamic_sampling": "on"}), Arm("without", {"consumer.dynamic_sampling": "off"})]
    if name == "tool_use":
        require_episodes(cfg)
        return [Arm("rl", {})]
    if name == "stability":
        return [Arm(n, o) for n, o in arm_specs()]
    raise ConfigError(f"unknown experiment {name!r}; choose async, objectives, replay, dynamic_sampling, "
                      "tool_use or stability")


def selected_arms(name: str, cfg: RlstreamConfig) -> list[Arm]:
    """The arms of `name`, or those `experiment.arms` names (ConfigError if it names none)."""
    arm_list = arms(name, cfg)
    only = cfg.experiment.arms
    if not only:
        return arm_list
    chosen = [a for a in arm_list if a.name in only]
    if not chosen:
        raise ConfigError(f"{','.join(only)} names no arm of {name!r}; its arms are "
                          f"{', '.join(a.name for a in arm_list)}", key="experiment.arms")
    return chosen


def _table(rows: dict[str, dict]) -> str:
    cols = ("reward", "heldout_accuracy", "kl", "clip_frac", "entropy", "samples_per_s", "versions",
            "seconds_to_target", "trained_to_target", "filtered", "collapsed", "ok")
    fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {arm} | " + " | ".join(fmt(m.get(c)) for c in cols) + " |" for arm, m in rows.items()]
    return "\n".join(lines)


def _phase_table(rows: dict[str, dict]) -> str:
    cols = ("c_wait", "c_train", "c_checkpoint", "c_publish", "c_step", "versions_per_s", "p_reload",
            "engine_s_per_step", "engine_busy", "tokens_per_step")
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for arm, m in rows.items():
        ph = m.get("phases") or {}
        lines.append(f"| {arm} | " + " | ".join(fmt(ph.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def _mean(vals):
    vals = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(vals) / len(vals) if vals else None


def combine(runs: list[dict]) -> dict:
    """One arm over its repetitions: samples/s = all trained / all RL seconds, other numbers averaged."""
    if len(runs) == 1:
        return runs[0]
    out = {k: _mean([r.get(k) for r in runs]) for k in ("reward", "heldout_accuracy", "best_accuracy", "kl",
                                                         "clip_frac", "entropy", "versions", "rl_seconds", "filtered")}
    trained = sum(r["samples_per_s"] * r["rl_seconds"] for r in runs)
    secs = sum(r["rl_seconds"] for r in runs)
    out["samples_per_s"] = trained / secs if secs else 0.0
    for key in ("seconds_to_target", "trained_to_target", "generated_to_target"):
        each = [r.get(key) for r in runs]
        out[key] = _mean(each) if all(t is not None for t in each) else None
        out[f"{key}_each"] = each
    out["collapsed"] = any(r["collapsed"] for r in runs)
    out["ok"] = all(r["ok"] for r in runs)
    out["error"] = next((r["error"] for r in runs if r["error"]), None)
    phases = [r["phases"] for r in runs if r.get("phases")]
    out["phases"] = {k: _mean([p[k] for p in phases]) for k in phases[0]} if phases else None
    out["samples_per_s_each"] = [r["samples_per_s"] for r in runs]
    out["run_dirs"] = [r["run_dir"] for r in runs]
    return out


def run_experiment(name: str, cfg: RlstreamConfig, seconds: float | None = None, reps: int | None = None) -> int:
    """Run every arm of `name`; print the tables and one JSON object last; 0 iff every arm ran cleanly."""
    out = experiment_result(name, cfg, seconds, reps)
    print(json.dumps(out, default=str), flush=True)
    return 0 if all(r["ok"] for r in out["arms"].values()) else 1


def experiment_result(name: str, cfg: RlstreamConfig, seconds: float | None = None,
                      reps: int | None = None) -> dict[str, Any]:
    """Run every arm of `name`, print the tables; the experiment's JSON object.

    With `reps` > 1 the arms are interleaved A B .. B A (ABBA order cancels a
    linear drift of the shared machine's load) and each arm's numbers combine
    its repetitions.
    """
    arm_list = selected_arms(name, cfg)
    warm = prepare_warm(cfg)
    target = min(1.0, warm.accuracy + cfg.demo.target_gain)
    budget = seconds or cfg.experiment.arm_seconds or ARM_SECONDS[name]
    versions = cfg.experiment.arm_versions or ARM_VERSIONS.get(name)
    reps = reps or cfg.experiment.reps or REPS[name]
    order = [a for r in range(reps) for a in (arm_list if r % 2 == 0 else arm_list[::-1])]
    say(f"experiment {name}: {len(arm_list)} arms x {reps} rep(s) x <= {budget:.0f} s"
        f"{f' or {versions} versions' if versions else ''}, "
        f"warm accuracy {warm.accuracy:.3f}, target {target:.3f}; order {[a.name for a in order]}")
    runs: dict[str, list[dict]] = {a.name: [] for a in arm_list}
    for i, arm in enumerate(order):
        stop = StopRule(target_accuracy=target if name in TO_TARGET else None, max_seconds=budget,
                        max_versions=versions)
        res = run_rl(cfg, warm, f"{name}-{arm.name}", stop, overrides={**COMMON.get(name, {}), **arm.overrides},
                     eval_every_s=15.0 if name in TO_TARGET else 30.0)
        m = arm_metrics(res)
        if name == "stability":
            m = stability_metrics(res, m)
        runs[arm.name].append(m)
        say(f"[{i + 1}/{len(order)}] {arm.name}: {m['samples_per_s']:.1f} samples/s, "
            f"{m['versions']} versions in {m['rl_seconds']:.0f} s, phases {m['phases']}")
    results = {a: {**combine(r), "overrides": {**COMMON.get(name, {}), **next(x.overrides for x in arm_list
                                                                              if x.name == a)}}
               for a, r in runs.items()}
    say(_table(results))
    say(_phase_table(results))
    out: dict[str, Any] = {"experiment": name, "warm_accuracy": warm.accuracy, "target_accuracy": target,
                           "metric": warm.metric, "arm_seconds": budget, "arm_versions": versions, "reps": reps,
                           "order": [a.name for a in order], "arms": results}
    if name in SUMMARIES and len(results) == 2:
        out.update(SUMMARIES[name](results, runs, reps))
    if name == "tool_use":
        out.update(tool_use_summary(cfg, warm, results))
    if name == "stability":
        from pathlib import Path

        out.update(stability_summary(results, Path(cfg.demo.work_dir) / "stability"))
        say(out["table_main"] + "\n\n" + out["table_mismatch"] + "\n\n" + out["table_by_staleness"])
    return out


def _async_summary(results: dict[str, dict], runs: dict[str, list[dict]], reps: int) -> dict:
    sync, asyn = results["sync"], next(v for k, v in results.items() if k != "sync")
    out: dict[str, Any] = {}
    out["async_speedup"] = (asyn["samples_per_s"] / sync["samples_per_s"]) if sync["samples_per_s"] else None
    if reps > 1:  # per ABBA pair: each sync run against the async run next to it
        ss, aa = runs["sync"], next(v for k, v in runs.items() if k != "sync")
        out["async_speedup_each"] = [round(a["samples_per_s"] / s["samples_per_s"], 3)
                                     for s, a in zip(ss, aa) if s["samples_per_s"]]
    out["sync_samples_per_s"] = sync["samples_per_s"]
    out["async_samples_per_s"] = asyn["samples_per_s"]
    out["sync_seconds_to_target"] = sync["seconds_to_target"]
    out["async_seconds_to_target"] = asyn["seconds_to_target"]
    st, at = sync["seconds_to_target"], asyn["seconds_to_target"]
    out["time_to_target_speedup"] = (st / at) if st and at else None
    return out


def _dynamic_sampling_summary(results: dict[str, dict], runs: dict[str, list[dict]], reps: int) -> dict:
    """Wall seconds to the target without / with (null when an arm missed it), and per pair."""
    w, wo = results["with"], results["without"]
    out: dict[str, Any] = {}
    for arm, m in (("with", w), ("without", wo)):
        for key in ("seconds_to_target", "trained_to_target", "generated_to_target"):
            out[f"{arm}_{key}"] = m[key]
    out["dynamic_sampling_speedup"] = _ratio(wo["seconds_to_target"], w["seconds_to_target"])
    out["trained_to_target_ratio"] = _ratio(wo["trained_to_target"], w["trained_to_target"])
    # a run without that missed the target needed more than its RL seconds: a lower bound
    # (only when every run with reached it; otherwise nothing is claimed)
    at_least = lambda r: r["seconds_to_target"] or r["rl_seconds"]  # noqa: E731
    with_each = [r["seconds_to_target"] for r in runs["with"]]
    if all(with_each):
        out["dynamic_sampling_speedup_at_least"] = _ratio(_mean([at_least(r) for r in runs["without"]]),
                                                          _mean(with_each))
    if reps > 1:  # per ABBA pair: each run against the other arm's run next to it
        out["dynamic_sampling_speedup_each"] = [_ratio(b["seconds_to_target"], a["seconds_to_target"])
                                                for a, b in zip(runs["with"], runs["without"])]
        out["dynamic_sampling_speedup_each_at_least"] = [_ratio(at_least(b), a["seconds_to_target"])
                                                         for a, b in zip(runs["with"], runs["without"])]
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


SUMMARIES = {"async": _async_summary, "dynamic_sampling": _dynamic_sampling_summary}
"""The headline numbers of the experiments that compare two arms."""
