"""`rlstream experiment stability`: MiniRL against DPPO, routing replay on and off, staleness
bounds 0 / 2 / 8 and `auto`, several seeds each; then a controlled training-inference
mismatch grown step by step. The arms, the tables with mean and spread over seeds, and the
plots (docs/stability.md).

    rlstream experiment stability -c configs/tiny-cpu.yaml      (62 runs: hours on 2 cores)
    python -m rlstream.harness.stability RUN.out [MORE.out ...] --out DIR   (tables and plots of runs' JSON)
    python -m rlstream.harness.stability --run-dirs runs/demo/runs --out DIR  (the same from the arms' run
                                                                             directories, for a cut-off run)

Every arm trains 120 policy versions (`arms.ARM_VERSIONS`, at most 300 s), so that arms
compare at equal optimizer steps however loaded the shared machine is; samples/s is measured
over the same run. Every arm runs `COMMON`: B = 4 groups per step, so that the producer runs
ahead of the trainer and records really age (with configs/tiny-cpu.yaml's B = 32 the
producer-bound pipeline never got past staleness 1, whatever the bound), and N = 2
mini-batches per step, so that a trust region has updates to bound. Arms:

- `main:{loss}-{replay}-{bound}-s{seed}` for loss in `LOSSES`, replay none / R3, bound
  k0 / k2 / k8 (`staleness.max_staleness`) or auto (`max_staleness: auto`, limits 0..8,
  start 2), seed in `SEEDS` (the producers' sampling and prompt-order seeds);
- `mismatch:{loss}-t{scale}` for loss in `MISMATCH_LOSSES`, scale in `MISMATCH_SCALES`:
  the trainer takes its log-probs at `scale` x the sampling temperature
  (`consumer.stress.logprob_temperature_scale`), max_staleness 2, replay none, seed 0;
- `auto_mismatch:{loss}-t{scale}` for `AUTO_MISMATCH`: `max_staleness: auto` under the
  largest mismatch, where the signals degrade however fresh the data (the controller's
  tightening, and the alert's case, on a real pipeline).

Per arm (beyond arms.arm_metrics): last-quarter means of ESS, mismatch KL (staleness 0),
gradient norm, the bound in force and the trained records' mean staleness; per staleness
bucket, ESS / KL / masked share over the run; `collapsed_by_accuracy` (final held-out accuracy
`COLLAPSE_ACC_DROP` below the warm start or `COLLAPSE_FROM_BEST` below the run's best).
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from rlstream.harness.arms import ARM_SECONDS, ARM_VERSIONS, COLLAPSE_ACC_DROP, arm_metrics
from rlstream.harness.report import by_staleness
from rlstream.harness.runs import RunResult

LOSSES = ("minirl", "dppo_tv")
REPLAYS = ("none", "R3")
BOUNDS = ("k0", "k2", "k8", "auto")
SEEDS = (0, 1, 2)
MISMATCH_LOSSES = ("minirl", "dppo_tv", "dppo_kl")
MISMATCH_SCALES = (1.0, 1.15, 1.3, 1.6)
AUTO_MISMATCH = (("minirl", 1.6), ("dppo_tv", 1.6))
COMMON = {"consumer.num_minibatches": 2, "consumer.groups_per_batch": 4}
AUTO_LIMITS = {"staleness.auto.min": 0, "staleness.auto.max": 8, "staleness.auto.start": 2}
COLLAPSE_FROM_BEST = 0.10


def bound_overrides(bound: str) -> dict[str, Any]:
    if bound == "auto":
        return {"staleness.max_staleness": "auto", **AUTO_LIMITS}
    return {"staleness.max_staleness": int(bound[1:]), "staleness.max_staleness_auto": False}


def seed_overrides(seed: int) -> dict[str, Any]:
    return {"producer.engine.seed": seed, "producer.prompts.seed": seed}


def main_arm(loss: str, replay: str, bound: str, seed: int) -> tuple[str, dict[str, Any]]:
    return (f"main:{loss}-{replay}-{bound}-s{seed}",
            {**COMMON, "consumer.loss.name": loss, "consumer.replay": replay, **bound_overrides(bound),
             **seed_overrides(seed)})


def mismatch_arm(loss: str, scale: float, bound: str = "k2") -> tuple[str, dict[str, Any]]:
    prefix = "mismatch" if bound != "auto" else "auto_mismatch"
    return (f"{prefix}:{loss}-t{scale:g}",
            {**COMMON, "consumer.loss.name": loss, "consumer.replay": "none",
             "consumer.stress.logprob_temperature_scale": scale, **bound_overrides(bound), **seed_overrides(0)})


def arm_specs() -> list[tuple[str, dict[str, Any]]]:
    """Every arm, seed-major (a seed's whole sweep runs close together in time: the shared
    machine's load drifts less within it), then the mismatch sweep."""
    out = [main_arm(loss, replay, bound, seed) for seed in SEEDS for loss in LOSSES
           for replay in REPLAYS for bound in BOUNDS]
    out += [mismatch_arm(loss, scale) for scale in MISMATCH_SCALES for loss in MISMATCH_LOSSES]
    return out + [mismatch_arm(loss, scale, "auto") for loss, scale in AUTO_MISMATCH]


# ---------------------------------------------------------------------------- per arm

def _ticks(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") == "tick"]


def _tail_mean(rows: list[dict], key: str, frac: float = 0.25) -> float | None:
    vals = [r[key] for r in _ticks(rows) if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    if not vals:
        return None
    tail = vals[-max(1, int(len(vals) * frac)):]
    return sum(tail) / len(tail)


def stability_metrics(res, base: dict) -> dict:
    """The stability experiment's additions to one arm's row (arms.arm_metrics)."""
    acc, best = res.final_accuracy, res.best_accuracy
    collapsed = acc is not None and (acc < res.warm_accuracy - COLLAPSE_ACC_DROP
                                     or (best is not None and acc < best - COLLAPSE_FROM_BEST))
    return {**base, "ess": _tail_mean(res.rows, "ess"), "mismatch_kl": _tail_mean(res.rows, "mismatch_kl"),
            "grad_norm": _tail_mean(res.rows, "grad_norm"), "bound": _tail_mean(res.rows, "max_staleness"),
            "bound_final": next((r["max_staleness"] for r in reversed(_ticks(res.rows))
                                 if r.get("max_staleness") is not None), None),
            "staleness_mean": _tail_mean(res.rows, "staleness_mean", 0.5),
            "bound_trace": [[r["version"], r["max_staleness"]] for r in _ticks(res.rows)
                            if r.get("max_staleness") is not None],
            "collapsed_by_accuracy": bool(collapsed), "by_staleness": by_staleness(res.rows)}


# ---------------------------------------------------------------------------- over seeds

def _group_name(arm: str) -> str:
    """main:minirl-none-k2-s1 -> main:minirl-none-k2 (the arm less its seed)."""
    return arm.rsplit("-s", 1)[0] if arm.startswith("main:") else arm


def spread(vals: list) -> dict:
    """mean, sample std, min, max and n of the numbers in `vals` (None when there are none)."""
    xs = [float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)
          and not math.isnan(float(v))]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(xs) / len(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


SUMMARY_KEYS = ("heldout_accuracy", "best_accuracy", "samples_per_s", "ess", "mismatch_kl", "kl", "clip_frac",
                "grad_norm", "bound", "staleness_mean")


def summarise(results: dict[str, dict]) -> dict[str, dict]:
    """Arms grouped over their seeds: each key's spread, and how many seeds collapsed."""
    groups: dict[str, list[dict]] = {}
    for arm, m in results.items():
        groups.setdefault(_group_name(arm), []).append(m)
    return {g: {**{k: spread([m.get(k) for m in ms]) for k in SUMMARY_KEYS},
                "collapsed": sum(bool(m.get("collapsed_by_accuracy")) for m in ms), "seeds": len(ms),
                "ok": all(m.get("ok") for m in ms)}
            for g, ms in groups.items()}


def _f(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def _ms(s: dict, spec=".3f") -> str:
    """mean ± std [min, max]."""
    if s["mean"] is None:
        return "-"
    if s["n"] == 1:
        return _f(s["mean"], spec)
    return f"{_f(s['mean'], spec)} ± {_f(s['std'], spec)} [{_f(s['min'], spec)}, {_f(s['max'], spec)}]"


def table(summary: dict[str, dict], prefixes: tuple[str, ...]) -> str:
    cols = [("heldout_accuracy", ".3f"), ("samples_per_s", ".0f"), ("ess", ".3f"), ("mismatch_kl", ".2e"),
            ("kl", ".2e"), ("clip_frac", ".3f"), ("grad_norm", ".3f"), ("bound", ".1f"), ("staleness_mean", ".2f")]
    head = "| arm | " + " | ".join(c for c, _ in cols) + " | collapsed | ok |"
    lines = [head, "|---" * (len(cols) + 3) + "|"]
    for g, s in summary.items():
        if g.startswith(prefixes):
            lines.append(f"| {g.removeprefix('main:')} | " + " | ".join(_ms(s[c], spec) for c, spec in cols)
                         + f" | {s['collapsed']}/{s['seeds']} | {s['ok']} |")
    return "\n".join(lines)


def staleness_table(results: dict[str, dict]) -> str:
    """Signals by a record's staleness, pooled over the main arms of each loss at bound k8."""
    pooled: dict[tuple[str, str], dict[str, list[float]]] = {}
    for arm, m in results.items():
        if not arm.startswith("main:") or "-k8-" not in arm:
            continue
        loss = arm.split(":")[1].split("-")[0]
        for bucket, sig in (m.get("by_staleness") or {}).items():
            for k, v in sig.items():
                pooled.setdefault((loss, bucket), {}).setdefault(k, []).append(v)
    lines = ["| loss | staleness | token share | ess | kl | masked/clipped |", "|---|---|---|---|---|---|"]
    for (loss, bucket), sig in sorted(pooled.items(), key=lambda kv: (kv[0][0], int(kv[0][1].rstrip("+")))):
        mean = {k: sum(v) / len(v) for k, v in sig.items()}
        lines.append(f"| {loss} | {bucket} | {_f(mean.get('token_share'))} | {_f(mean.get('ess'))} | "
                     f"{_f(mean.get('kl'), '.2e')} | {_f(mean.get('clip_frac'))} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plots

def plot(summary: dict[str, dict], results: dict[str, dict], out_dir: Path) -> list[Path]:
    """accuracy_by_bound.png, signals_by_bound.png, mismatch_sweep.png (when there are mismatch arms),
    signals_by_staleness.png,
    auto_bound.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "accuracy_by_bound.png", out_dir / "signals_by_bound.png",
             out_dir / "mismatch_sweep.png", out_dir / "signals_by_staleness.png", out_dir / "auto_bound.png"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    _by_bound(ax, summary, "heldout_accuracy", "held-out accuracy (mean ± std over seeds)")
    _save(fig, paths[0])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
    for ax, key in zip(axes, ("ess", "clip_frac", "grad_norm")):
        _by_bound(ax, summary, key, key)
    _save(fig, paths[1])
    if not any(g.startswith("mismatch:") for g in summary):  # a cut-off run: no empty plot
        paths.remove(out_dir / "mismatch_sweep.png")
    else:
        _mismatch_plot(plt, summary, out_dir / "mismatch_sweep.png")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
    for ax, key in zip(axes, ("ess", "kl", "clip_frac")):
        _by_staleness(ax, results, key)
    _save(fig, out_dir / "signals_by_staleness.png")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for arm, m in results.items():
        if arm.endswith("-auto-s0") or arm.startswith("auto_mismatch:"):
            trace = m.get("bound_trace") or []
            ax.step([v for v, _ in trace], [b for _, b in trace], where="post", label=arm.removeprefix("main:"))
    ax.set_xlabel("policy version")
    ax.set_ylabel("max_staleness in force")
    ax.set_title("max_staleness: auto (seed 0; auto_mismatch at trainer temperature x1.6)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out_dir / "auto_bound.png")
    return paths


def _mismatch_plot(plt, summary: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
    for ax, key in zip(axes, ("heldout_accuracy", "mismatch_kl", "clip_frac")):
        for loss in MISMATCH_LOSSES:
            pts = [(sc, summary.get(f"mismatch:{loss}-t{sc:g}", {}).get(key, {}).get("mean")) for sc in MISMATCH_SCALES]
            pts = [(x, y) for x, y in pts if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=loss)
        ax.set_xlabel("trainer temperature / sampler temperature")
        ax.set_title(key, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


def _by_bound(ax, summary: dict, key: str, title: str) -> None:
    for loss in LOSSES:
        for replay in REPLAYS:
            s = [summary.get(f"main:{loss}-{replay}-{b}", {}).get(key, {}) for b in BOUNDS]
            xs = [i for i, x in enumerate(s) if x.get("mean") is not None]
            ax.errorbar(xs, [s[i]["mean"] for i in xs], yerr=[s[i]["std"] for i in xs], marker="o", capsize=3,
                        label=f"{loss} {replay}")
    ax.set_xticks(range(len(BOUNDS)), BOUNDS)
    ax.set_xlabel("max_staleness")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _by_staleness(ax, results: dict, key: str) -> None:
    for loss in LOSSES:
        pooled: dict[int, list[float]] = {}
        for arm, m in results.items():
            if arm.startswith(f"main:{loss}-") and "-k8-" in arm:
                for bucket, sig in (m.get("by_staleness") or {}).items():
                    if sig.get(key) is not None:
                        pooled.setdefault(int(bucket.rstrip("+")), []).append(sig[key])
        xs = sorted(pooled)
        ax.plot(xs, [sum(pooled[x]) / len(pooled[x]) for x in xs], marker="o", label=loss)
    ax.set_xlabel("record staleness (versions; 8 = 8+) at max_staleness 8")
    ax.set_title(key, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)


def stability_summary(results: dict[str, dict], out_dir: Path | None) -> dict:
    """The experiment's JSON additions: grouped spreads, the markdown tables, the plots."""
    summary = summarise(results)
    out: dict[str, Any] = {"groups": summary, "table_main": table(summary, ("main:",)),
                           "table_mismatch": table(summary, ("mismatch:", "auto_mismatch:")),
                           "table_by_staleness": staleness_table(results)}
    if out_dir is not None:
        try:
            out["plots"] = [str(p) for p in plot(summary, results, out_dir)]
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the pictures
            out["plots_error"] = str(e)
    return out


# ---------------------------------------------------------------------------- from run directories

def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text and text.strip() else "?"


def arms_from_run_dirs(root: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Arms' rows rebuilt from the run directories `stability-<arm>-<stamp>` under `root` (each run's
    summary.json and progress.jsonl, through the experiment's own arm_metrics and stability_metrics):
    the tables of an experiment cut off before it printed its JSON. Per arm the newest directory with
    a summary.json and at least one trained version counts. Returns (arms, missing): `missing` maps
    every arm of `arm_specs()` without such a run to why (failed: its error's first line; cut off:
    no summary.json; not run)."""
    import json

    arms: dict[str, dict] = {}
    missing: dict[str, str] = {}
    for d in sorted(root.glob("stability-*"), key=lambda d: d.name[-15:]):  # stamp YYYYmmdd-HHMMSS
        name = d.name.removeprefix("stability-")[:-16]
        summary = d / "summary.json"
        if not summary.exists():
            missing.setdefault(name, f"cut off: no summary.json in {d.name}")
            continue
        fields = json.loads(summary.read_text())
        if not fields.get("versions"):
            missing.setdefault(name, f"failed: {_first_line(fields.get('error') or 'no version trained')}")
            continue
        rows = [json.loads(line) for line in (d / "progress.jsonl").read_text().splitlines() if line.strip()]
        res = RunResult(**fields, rows=rows)
        arms[name] = stability_metrics(res, arm_metrics(res))
        missing.pop(name, None)
    for name, _ in arm_specs():
        if name not in arms:
            missing.setdefault(name, "not run")
    return arms, missing


def missing_table(missing: dict[str, str]) -> str:
    lines = ["| arm without a result | why |", "|---|---|"]
    return "\n".join(lines + [f"| {a} | {why} |" for a, why in missing.items()])


def main(argv: list[str] | None = None) -> int:
    """Tables and plots from the JSON of one or more runs of the experiment (e.g. a run of some
    arms redone with `experiment.arms`): the arms of later files replace earlier ones.

        python -m rlstream.harness.stability RUN1.out [RUN2.out ...] --out DIR
    """
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="stdout of `rlstream experiment stability` (its last line is the JSON)")
    p.add_argument("--run-dirs", help="instead: a directory of the arms' run directories (runs/demo/runs)")
    p.add_argument("--out", required=True, help="directory for tables.md, arms.json and the plots")
    a = p.parse_args(argv)
    if bool(a.runs) == bool(a.run_dirs):
        p.error("give either runs' stdout files or --run-dirs")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms: dict[str, dict] = {}
    missing: dict[str, str] = {}
    warm = None
    for path in a.runs:
        res = json.loads(Path(path).read_text().strip().splitlines()[-1])
        arms.update(res["arms"])
        warm = res.get("warm_accuracy", warm)
    if a.run_dirs:
        arms, missing = arms_from_run_dirs(Path(a.run_dirs))
        warm = next((json.loads(Path(m["run_dir"], "summary.json").read_text())["warm_accuracy"]
                     for m in arms.values()), None)
    out = stability_summary(arms, out_dir)
    text = "\n\n".join(out[k] for k in ("table_main", "table_mismatch", "table_by_staleness"))
    if missing:
        text += "\n\n" + missing_table(missing)
    (out_dir / "tables.md").write_text(text + "\n")
    # the shape of the experiment's JSON (tests/bench/stability.py --from-json reads it); arm_seconds and
    # arm_versions are the experiment's defaults, which the console output's first line confirms
    (out_dir / "arms.json").write_text(json.dumps(
        {"experiment": "stability", "warm_accuracy": warm, "arm_seconds": ARM_SECONDS["stability"],
         "arm_versions": ARM_VERSIONS["stability"], "arms": arms, "missing": missing,
         **{k: v for k, v in out.items() if k != "groups"}}, default=str) + "\n")
    print(text)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
