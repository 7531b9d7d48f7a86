"""The run report: `report.md` plus PNG plots from a progress log.

    from rlstream.harness.report import write_report
    write_report("runs/demo/runs/demo-.../progress.jsonl", "runs/demo/runs/demo-.../report", summary)

    python -m rlstream.harness.report PROGRESS.jsonl OUT_DIR

The progress log (written by ops/harness/demo.py) holds one JSON object per line:
- `kind: "tick"`: one scrape of every service's /metrics: `time` (s since the
  services were up), `version` (trainer), `reward_mean` (producers, over the
  interval), `kl` (training-inference KL of the last step), `entropy`,
  `clip_frac`, `staleness_mean` (groups gated in the interval),
  `samples_per_s` (trained), `generated_per_s`, `outcomes`, `lag`;
- `kind: "eval"`: `time`, `version`, `heldout_accuracy` (the tracked metric, `metric`:
  avg@k = mean accuracy over k samples per held-out problem, or greedy),
  `heldout_greedy`, `heldout_pass_at_k`.

Ticks also carry the stability signals (docs/stability.md): `ess`, `mismatch_kl`,
`grad_norm`, `max_staleness` (the bound in force) and `by_staleness` ({bucket:
{ess, kl, clip_frac, is_truncated_frac, token_share}}).

Plots (matplotlib, Agg): reward, held-out accuracy, training-inference KL,
staleness, samples/s, ESS, mismatch, gradient norm and the bound, each over
policy versions; one file each and an overview grid. Missing values (e.g.
before the first trained step) are skipped. report.md adds the signals by
staleness (`by_staleness`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

PLOTS = (
    # (file stem, row kind, field, y label, title)
    ("reward", "tick", "reward_mean", "mean reward", "Rollout reward (producers)"),
    ("heldout_accuracy", "eval", "heldout_accuracy", "accuracy", "Held-out accuracy"),
    ("kl", "tick", "kl", "KL(mu_old || pi_old)", "Training-inference KL"),
    ("staleness", "tick", "staleness_mean", "versions", "Staleness of gated groups"),
    ("samples_per_s", "tick", "samples_per_s", "samples / s", "Trained samples per second"),
    ("ess", "tick", "ess", "normalised ESS", "ESS of the token IS weights"),
    ("mismatch_kl", "tick", "mismatch_kl", "KL at staleness 0", "Training-inference mismatch"),
    ("grad_norm", "tick", "grad_norm", "pre-clip norm", "Gradient norm"),
    ("max_staleness", "tick", "max_staleness", "versions", "max_staleness in force"),
)


def read_rows(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict], kind: str, key: str) -> tuple[list[float], list[float]]:
    """(versions, values) of one field; ticks before the first version change are kept."""
    xs, ys = [], []
    for r in rows:
        if r.get("kind") == kind and r.get(key) is not None:
            xs.append(r["version"])
            ys.append(r[key])
    return xs, ys


def _metric_name(rows: list[dict]) -> str:
    return next((r["metric"] for r in rows if r.get("kind") == "eval" and r.get("metric")), "accuracy")


def _plot_one(ax, rows, kind, key, ylabel, title, hline=None) -> None:
    xs, ys = series(rows, kind, key)
    label = _metric_name(rows) if key == "heldout_accuracy" else None
    ax.plot(xs, ys, marker="o" if kind == "eval" else None, markersize=3, linewidth=1.2, label=label)
    if key == "heldout_accuracy":
        gx, gy = series(rows, "eval", "heldout_greedy")
        if gy and label != "greedy":
            ax.plot(gx, gy, marker="s", markersize=2.5, linewidth=0.9, alpha=0.7, label="greedy")
        if hline is None:
            ax.legend(fontsize=7, loc="lower right")
    if hline is not None:
        for y, label, style in hline:
            ax.axhline(y, linestyle=style, color="grey", linewidth=0.8, label=label)
        ax.legend(fontsize=7, loc="lower right")
    if key == "kl" and ys and min(ys) > 0:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("policy version")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not xs:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")


def plot_all(rows: list[dict], out_dir: Path, summary: dict | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summary or {}
    lines = []
    if summary.get("warm_accuracy") is not None:
        lines.append((summary["warm_accuracy"], "warm start", "--"))
    if summary.get("target_accuracy") is not None:
        lines.append((summary["target_accuracy"], "target", ":"))
    paths = []
    for stem, kind, key, ylabel, title in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        _plot_one(ax, rows, kind, key, ylabel, title, lines if stem == "heldout_accuracy" and lines else None)
        fig.tight_layout()
        p = out_dir / f"{stem}.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    fig, axes = plt.subplots(3, 3, figsize=(14, 10), dpi=100)
    for ax, (stem, kind, key, ylabel, title) in zip(axes.flat, PLOTS):
        _plot_one(ax, rows, kind, key, ylabel, title, lines if stem == "heldout_accuracy" and lines else None)
    fig.tight_layout()
    p = out_dir / "overview.png"
    fig.savefig(p)
    plt.close(fig)
    return [p, *paths]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _window_mean(rows, kind, key, first: bool, frac: float = 0.25):
    _, ys = series(rows, kind, key)
    if not ys:
        return None
    n = max(1, int(len(ys) * frac))
    w = ys[:n] if first else ys[-n:]
    return sum(w) / len(w)


def by_staleness(rows: list[dict]) -> dict[str, dict]:
    """Per staleness bucket, each signal's mean over the second half's ticks that saw the bucket."""
    ticks = [r for r in rows if r.get("kind") == "tick"]
    acc: dict[str, dict[str, list[float]]] = {}
    for r in ticks[len(ticks) // 2:]:
        for bucket, sig in (r.get("by_staleness") or {}).items():
            for k, v in sig.items():
                if v is not None and v == v:
                    acc.setdefault(bucket, {}).setdefault(k, []).append(v)
    order = sorted(acc, key=lambda b: int(b.rstrip("+")))
    return {b: {k: sum(v) / len(v) for k, v in acc[b].items()} for b in order}


def markdown(rows: list[dict], summary: dict, plots: list[Path]) -> str:
    evals = [r for r in rows if r.get("kind") == "eval"]
    ticks = [r for r in rows if r.get("kind") == "tick"]
    acc = summary.get("accounting") or {}
    out = ["# rlstream run report", ""]
    out += ["## Outcome", "", "| | |", "|---|---|"]
    for k in ("label", "metric", "warm_accuracy", "warm_greedy_accuracy", "target_accuracy", "final_accuracy", "best_accuracy",
              "reached_target", "seconds_to_target", "versions", "samples_per_s", "startup_seconds",
              "rl_seconds", "sft_seconds", "sft_steps", "sft_reused", "demo_wall_seconds", "error"):
        if k in summary:
            out.append(f"| {k} | {_fmt(summary[k])} |")
    out += ["", "## Trends (first vs last quarter of the run)", "",
            "| metric | first quarter | last quarter |", "|---|---|---|"]
    for stem, kind, key, _, title in PLOTS:
        out.append(f"| {title} | {_fmt(_window_mean(rows, kind, key, True))} | "
                   f"{_fmt(_window_mean(rows, kind, key, False))} |")
    out += ["", "## Stability signals by a record's staleness (second half of the run)", "",
            "| staleness | token share | ESS | KL(mu_old, pi_old) | masked/clipped | IS truncated |",
            "|---|---|---|---|---|---|"]
    out += [f"| {b} | {_fmt(s.get('token_share'))} | {_fmt(s.get('ess'))} | {_fmt(s.get('kl'))} | "
            f"{_fmt(s.get('clip_frac'))} | {_fmt(s.get('is_truncated_frac'))} |" for b, s in by_staleness(rows).items()]
    out += ["", "## Record accounting", "",
            "Every record published on the rollouts topic ends in exactly one consumer outcome; "
            "`held` are whole groups waiting for a full batch at shutdown (their offsets stay in "
            "the checkpoint, so a restarted consumer trains them).", "",
            "| published | trained | dropped_stale | timed_out | duplicate | dlq | filtered | held | balanced |",
            "|---|---|---|---|---|---|---|---|---|",
            "| " + " | ".join(_fmt(acc.get(k)) for k in ("published", "trained", "dropped_stale", "timed_out",
                                                       "duplicate", "dlq", "filtered", "held", "ok")) + " |"]
    codes = summary.get("exit_codes") or {}
    out += ["", "## Processes", "", "| process | exit code |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in codes.items()]
    out += ["", "## Plots", ""]
    out += [f"![{p.stem}]({p.name})" for p in plots]
    out += ["", "## Held-out accuracy by version", "",
            f"`accuracy` is the tracked metric ({_metric_name(rows)}: mean exact-match accuracy over the "
            "samples per problem at the rollout temperature for avg@k); `greedy` is the greedy answer's.", "",
            "| time (s) | version | accuracy | greedy | pass@k |", "|---|---|---|---|---|"]
    out += [f"| {r['time']:.0f} | {r['version']} | {r['heldout_accuracy']:.3f} | {_fmt(r.get('heldout_greedy'))} "
            f"| {_fmt(r.get('heldout_pass_at_k'))} |" for r in evals]
    out += ["", f"{len(ticks)} progress observations; raw data in `progress.jsonl`.", ""]
    return "\n".join(out)


def write_report(progress_path: str | os.PathLike, out_dir: str | os.PathLike,
                 summary: dict | None = None) -> Path:
    """Write `out_dir/report.md` and the PNGs; return the path of report.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(progress_path) if Path(progress_path).exists() else []
    summary = summary or {}
    plots = plot_all(rows, out, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    md = out / "report.md"
    md.write_text(markdown(rows, summary, plots))
    return md


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("progress")
    p.add_argument("out_dir")
    p.add_argument("--summary", help="summary.json of the run")
    a = p.parse_args(argv)
    summary = json.loads(Path(a.summary).read_text()) if a.summary else {}
    print(write_report(a.progress, a.out_dir, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
