"""Figures of tests/bench/peers.py from each run's held-out timeline (pure functions, unit-tested).

A timeline is a list of {"time": seconds since the arm was launched,
"heldout_accuracy": ...} rows in time order, the warm start first.

    time_to_target(evals, target, confirmations=2)   seconds at the 2nd evaluation in a row >= target
    accuracy_at(evals, t)                            the newest evaluation at or before t
    summarize(rl_runs, trl_runs, target)             the bench's ratios
"""
from __future__ import annotations

from statistics import median


def time_to_target(evals: list[dict], target: float, confirmations: int = 2) -> float | None:
    """The demo's stop rule (ops/harness/runs.py `StopRule`) applied to a timeline:
    the time of the `confirmations`-th evaluation in a row at or above `target`; None if never."""
    hits = 0
    for e in evals:
        hits = hits + 1 if e["heldout_accuracy"] >= target else 0
        if hits >= confirmations:
            return e["time"]
    return None


def accuracy_at(evals: list[dict], t: float) -> float | None:
    """Held-out accuracy of the newest evaluation at or before `t` (None before the first)."""
    seen = [e["heldout_accuracy"] for e in evals if e["time"] <= t + 1e-9]
    return seen[-1] if seen else None


def _ratio(a, b) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 4)


def summarize(rl_runs: list[dict], trl_runs: list[dict], target: float) -> dict:
    """The bench's figures. Each run: {"evals": [...], "samples_per_s": float}.

    time_to_target_over_trl: median over runs of rlstream's seconds to the target over
    TRL's; None when a TRL run (or an rlstream run) missed it: then compare
    heldout_at_equal_time, the median accuracy of each system at the latest time
    every run of both reached (`equal_time_s`)."""
    ttt = {name: [time_to_target(r["evals"], target) for r in runs]
           for name, runs in (("rlstream", rl_runs), ("trl", trl_runs))}
    med = {k: (median(v) if v and None not in v else None) for k, v in ttt.items()}
    ends = [r["evals"][-1]["time"] for r in rl_runs + trl_runs if r["evals"]]
    t_eq = min(ends) if ends else None
    at = {name: [accuracy_at(r["evals"], t_eq) for r in runs] if t_eq is not None else []
          for name, runs in (("rlstream", rl_runs), ("trl", trl_runs))}
    sps = {name: [r["samples_per_s"] for r in runs if r.get("samples_per_s")]
           for name, runs in (("rlstream", rl_runs), ("trl", trl_runs))}
    return {
        "target_accuracy": target,
        "seconds_to_target": {k: v for k, v in ttt.items()},
        "seconds_to_target_median": med,
        "time_to_target_over_trl": _ratio(med["rlstream"], med["trl"]),
        "equal_time_s": t_eq,
        "heldout_at_equal_time": {k: (median([x for x in v if x is not None]) if any(x is not None for x in v)
                                      else None) for k, v in at.items()},
        "heldout_at_equal_time_each": at,
        "samples_per_s_median": {k: (median(v) if v else None) for k, v in sps.items()},
        "samples_per_s_over_trl": _ratio(median(sps["rlstream"]) if sps["rlstream"] else None,
                                         median(sps["trl"]) if sps["trl"] else None),
    }
