"""What is measured of one experiment arm, and how long an arm runs: shared by the
experiments (ops/harness/experiments.py), the stability tables (ops/harness/stability.py)
and the benches that compare runs.

- `arm_metrics(res)`: one table row from a `RunResult` (last-quarter means, collapse,
  samples to the target, `phase_profile`: where the time of a step went).
- `ARM_SECONDS`, `ARM_VERSIONS`: an arm's length per experiment.
"""
from __future__ import annotations

COLLAPSE_ACC_DROP = 0.10
COLLAPSE_KL = 0.05
ARM_SECONDS = {"async": 240.0, "objectives": 90.0, "replay": 60.0, "dynamic_sampling": 480.0, "tool_use": 300.0,
               "stability": 300.0}
ARM_VERSIONS = {"stability": 120}
"""Experiments whose arms stop after a number of policy versions (their seconds are a cap): every
arm takes the same number of optimizer steps, however loaded the shared machine is."""


def _last_quarter(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get("kind") == "tick" and r.get(key) is not None]
    if not vals:
        return None
    tail = vals[-max(1, len(vals) // 4):]
    return sum(tail) / len(tail)


def phase_profile(rows: list[dict], skip_frac: float = 0.25) -> dict | None:
    """Where the time went in the steady part of a run (first `skip_frac` of ticks skipped).

    Per global step (means): consumer `wait` (for B groups), `train`, `checkpoint`,
    `publish`, `step` (their sum); producer `reload` seconds per reload and
    `engine_s_per_step` (seconds vLLM spent stepping per trained version);
    `engine_busy` = engine seconds / wall seconds; `staleness_refusals_per_s`.
    """
    ticks = [r for r in rows if r.get("kind") == "tick" and r.get("cum")]
    if len(ticks) < 3:
        return None
    a, b = ticks[int(len(ticks) * skip_frac)], ticks[-1]
    d = {k: b["cum"][k] - a["cum"].get(k, 0.0) for k in b["cum"]}
    wall = b["time"] - a["time"]
    steps = d["c_train_n"] or float("nan")
    out = {f"c_{ph}": d[f"c_{ph}_s"] / steps for ph in ("wait", "train", "checkpoint", "publish")}
    out["c_step"] = sum(out.values())
    out["versions_per_s"] = d["c_train_n"] / wall if wall > 0 else None
    out["p_reload"] = d["p_reload_s"] / d["p_reload_n"] if d["p_reload_n"] else None
    out["engine_s_per_step"] = d["p_engine_s"] / steps
    out["engine_busy"] = d["p_engine_s"] / wall if wall > 0 else None
    out["tokens_per_step"] = d["p_tokens"] / steps
    out["staleness_refusals_per_s"] = d["p_held_staleness"] / wall if wall > 0 else None
    out["window_s"] = wall
    return {k: (None if v is None or v != v else round(v, 4)) for k, v in out.items()}


def samples_to(rows: list[dict], t: float | None) -> tuple[int | None, int | None]:
    """(trained, generated) samples at `t` seconds of RL: the last progress row at or before it."""
    if t is None:
        return None, None
    ticks = [r for r in rows if r.get("kind") == "tick" and r["time"] <= t + 1e-6]
    if not ticks:
        return 0, 0
    return int(ticks[-1]["outcomes"]["trained"]), int(sum(r.get("generated", 0) for r in ticks))


def arm_metrics(res) -> dict:
    """One row of the experiment table from a `RunResult`."""
    kl = _last_quarter(res.rows, "kl")
    trained_to_target, generated_to_target = samples_to(res.rows, res.seconds_to_target)
    collapsed = ((res.final_accuracy is not None and res.final_accuracy < res.warm_accuracy - COLLAPSE_ACC_DROP)
                 or (kl is not None and kl > COLLAPSE_KL))
    return {
        "reward": _last_quarter(res.rows, "reward_mean"), "heldout_accuracy": res.final_accuracy,
        "best_accuracy": res.best_accuracy, "kl": kl, "clip_frac": _last_quarter(res.rows, "clip_frac"),
        "entropy": _last_quarter(res.rows, "entropy"), "collapsed": bool(collapsed),
        "filtered": res.accounting.get("filtered"),
        "samples_per_s": res.samples_per_s, "versions": res.versions, "rl_seconds": res.rl_seconds,
        "seconds_to_target": res.seconds_to_target, "trained_to_target": trained_to_target,
        "generated_to_target": generated_to_target, "ok": res.ok, "error": res.error,
        "run_dir": res.run_dir, "phases": phase_profile(res.rows),
    }
