"""The tool_use experiment's measurements: held-out accuracy with the tool vs without,
before and after RL (`rlstream experiment tool_use -c configs/tiny-calculator.yaml`).

    out = tool_use_summary(cfg, warm, results)     # JSON fields, and writes tool_use.md

"Before" is the warm start (`Warm.scores`, measured by `prepare_warm`: the plain
warm start taught the call format, ops/harness/sft.py `ToolSft`); "after" is
the newest weight version of the RL run, scored the same way
(`rlstream.harness.demo.score_dir` with `producer.episodes`). WITH the tool: one
calculator episode per held-out problem (ops/harness/tool_eval.py); WITHOUT:
single-turn on the same prompts. Each side: the run's metric (avg@8 at the
rollout temperature) and greedy; plus the greedy tool-call rate and how the
greedy episodes ended. The markdown report (`tool_use.md` in the run directory)
has the table and a few greedy transcripts of each model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import ConfigError
from rlstream.common.weights.store import WeightStore
from rlstream.harness.demo import score_dir
from rlstream.harness.runs import Warm, say

COLUMNS = (("accuracy", "with tool ({metric})"), ("greedy", "with tool (greedy)"),
           ("no_tool_avg", "without ({metric})"), ("no_tool", "without (greedy)"),
           ("call_rate", "tool call rate"), ("calls_per_episode", "calls / episode"))


def require_episodes(cfg: RlstreamConfig) -> None:
    if cfg.producer.episodes is None:
        raise ConfigError("the tool_use experiment needs multi-turn episodes: use configs/tiny-calculator.yaml "
                          "or set producer.episodes", key="producer.episodes")


def final_version(run_dir: str) -> tuple[int, Path] | None:
    """(version, directory) of the newest weight version the run published (None if none)."""
    store = WeightStore(Path(run_dir) / "weights", keep=1 << 30)  # reads only
    versions = store.versions()
    return (versions[-1], Path(store.path(versions[-1]))) if versions else None


def _pick(scores: dict) -> dict:
    keep = [k for k, _ in COLUMNS] + ["pass", "ends", "examples"]
    return {k: scores.get(k) for k in keep}


def tool_use_summary(cfg: RlstreamConfig, warm: Warm, results: dict[str, dict]) -> dict[str, Any]:
    """Scores before and after RL, the tool's gain at each, RL's gain on each; writes tool_use.md."""
    arm = next(iter(results.values()))
    run_dir = arm.get("run_dir") or (arm.get("run_dirs") or [None])[-1]
    before = _pick(warm.scores)
    final = final_version(run_dir) if run_dir else None
    after = None
    if final is not None:
        after = _pick(score_dir(final[1], warm.heldout_path, warm.metric, cfg.producer.temperature,
                                cfg.producer.max_tokens, cfg.producer.episodes))
        after["version"] = final[0]
    out: dict[str, Any] = {"before_rl": before, "after_rl": after,
                           "tool_gain_before_rl": _diff(before, "accuracy", "no_tool_avg"),
                           "tool_gain_after_rl": _diff(after, "accuracy", "no_tool_avg")}
    if after is not None:
        out["rl_gain_with_tool"] = _diff2(after, before, "accuracy")
        out["rl_gain_without_tool"] = _diff2(after, before, "no_tool_avg")
    if run_dir:
        path = Path(run_dir) / "tool_use.md"
        path.write_text(report(warm, before, after, out))
        say(f"report: {path}")
    return out


def _diff(s: dict | None, a: str, b: str) -> float | None:
    if not s or s.get(a) is None or s.get(b) is None:
        return None
    return round(s[a] - s[b], 4)


def _diff2(x: dict, y: dict, key: str) -> float | None:
    if x.get(key) is None or y.get(key) is None:
        return None
    return round(x[key] - y[key], 4)


def report(warm: Warm, before: dict, after: dict | None, out: dict) -> str:
    """The markdown report: the with/without table before and after RL, and transcripts."""
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    heads = [h.format(metric=warm.metric) for _, h in COLUMNS]
    lines = ["# tool_use: held-out accuracy with the calculator tool vs without", "",
             f"Held-out problems: {warm.heldout_path}. With the tool: one calculator episode per problem; "
             "without: single-turn on the same prompts.", "",
             "| model | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for name, s in (("warm start (format SFT)", before), ("after RL", after)):
        if s is not None:
            lines.append(f"| {name} | " + " | ".join(fmt(s.get(k)) for k, _ in COLUMNS) + " |")
    lines += ["", *(f"- {k}: {fmt(v)}" for k, v in out.items() if not isinstance(v, dict) and v is not None)]
    for name, s in (("warm start", before), ("after RL", after)):
        if s is not None:
            lines += ["", f"Greedy episodes of the {name} (end reasons {s.get('ends')}):", "", "```",
                      *(s.get("examples") or []), "```"]
    return "\n".join(lines) + "\n"
