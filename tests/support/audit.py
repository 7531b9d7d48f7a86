"""The consumer's state, read from outside: its audit log and its checkpoints.

The consumer appends one JSON line per global step to
`<checkpoint_dir>/trained.jsonl` when it trains the step: {step, version
(after the step), trained: [rollout ids], run (the incarnation)}. Checkpoints
come on a cadence, so after a crash the steps since the last checkpoint are
redone and logged again under the same step numbers by the next run. Which
lines count is the lineage of the newest checkpoint (consumer/checkpoint/files.py):
`lineage_entries`. `audit_steps` / `audit_entries` (the last line per step,
any run) measure progress while the consumer runs.
"""
from __future__ import annotations

import json
from pathlib import Path


def audit_entries(checkpoint_dir: Path) -> dict[int, dict]:
    """step -> its audit entry (the last line per step, whichever run wrote it)."""
    return {e["step"]: e for e in _lines(checkpoint_dir)}


def lineage_entries(checkpoint_dir: Path) -> dict[int, dict]:
    """step -> its audit entry in the lineage of the newest committed checkpoint
    (the final model, after a clean stop). Raises AssertionError when a step of the
    lineage has no line or two."""
    st = committed_checkpoint(checkpoint_dir)
    assert st is not None and st.runs, "no committed checkpoint with a lineage"
    starts = [s for _, s in st.runs] + [st.step]
    span = {run: (lo, hi) for (run, _), lo, hi in zip(st.runs, starts, starts[1:])}
    out: dict[int, dict] = {}
    for e in _lines(checkpoint_dir):
        lo, hi = span.get(e.get("run"), (0, 0))
        if lo < e["step"] <= hi:
            assert e["step"] not in out, f"step {e['step']} logged twice by run {e['run']}"
            out[e["step"]] = e
    assert sorted(out) == list(range(1, st.step + 1)), f"lineage {st.runs} misses steps: {sorted(out)}"
    return out


def lineage_steps(checkpoint_dir: Path) -> dict[int, list[str]]:
    """step -> trained rollout ids, in the lineage of the newest committed checkpoint."""
    return {s: e["trained"] for s, e in lineage_entries(checkpoint_dir).items()}


def _lines(checkpoint_dir: Path) -> list[dict]:
    path = Path(checkpoint_dir) / "trained.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def audit_steps(checkpoint_dir: Path) -> dict[int, list[str]]:
    """step -> trained rollout ids (the last line per step is the committed one)."""
    return {s: e["trained"] for s, e in audit_entries(checkpoint_dir).items()}


def audit_lines(checkpoint_dir: Path) -> int:
    """Lines in the audit log (a redone step counts again: progress of any incarnation)."""
    path = Path(checkpoint_dir) / "trained.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def step_staleness(entries: dict[int, dict], rollouts: dict) -> dict[int, int]:
    """step -> the largest staleness among the samples it trained (docs/algorithm.md:
    trainer version at the optimizer step - the sample's oldest token version,
    the gate's own rule). `entries` from `audit_entries`; `rollouts` maps rollout
    id -> Rollout (census.read_rollouts, read after the entries: it must hold
    every record they trained)."""
    from rlstream.consumer.stream.gate import sample_staleness

    return {s: max(sample_staleness(rollouts[rid], e["version"] - 1) for rid in e["trained"])
            for s, e in entries.items() if e["trained"]}


def committed_checkpoint(checkpoint_dir: Path):
    """The newest complete checkpoint's CheckpointState, or None."""
    from rlstream.consumer.checkpoint.files import CheckpointManager

    latest = CheckpointManager(checkpoint_dir).latest()
    return None if latest is None else latest[0]
