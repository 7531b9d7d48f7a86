"""The consumer's state, read from outside: its audit log and its checkpoints.

The consumer appends one JSON line per global step to
`<checkpoint_dir>/trained.jsonl` before that step's checkpoint commits:
{step, version (after the step), trained: [rollout ids]}. A step whose
checkpoint never committed is redone after a restart and logged again under
the same step number: the last line per step is the committed one.
"""
from __future__ import annotations

import json
from pathlib import Path


def audit_entries(checkpoint_dir: Path) -> dict[int, dict]:
    """step -> its audit entry (the last line per step)."""
    path = Path(checkpoint_dir) / "trained.jsonl"
    entries: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                entries[e["step"]] = e
    return entries


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
    from consumer.staleness import sample_staleness

    return {s: max(sample_staleness(rollouts[rid], e["version"] - 1) for rid in e["trained"])
            for s, e in entries.items() if e["trained"]}


def committed_checkpoint(checkpoint_dir: Path):
    """The newest complete checkpoint's CheckpointState, or None."""
    from consumer.checkpoint import CheckpointManager

    latest = CheckpointManager(checkpoint_dir).latest()
    return None if latest is None else latest[0]
