"""Which audit lines made a checkpoint's model: the steps a replay runs.

A crash redoes the steps since the last checkpoint, and the next incarnation
logs them again under the same step numbers, so the audit log may hold a step
twice. A checkpoint lists its lineage, `runs`: [run id, step it resumed at] of
every incarnation whose steps made its model (consumer/checkpoint/files.py). The
lines that count are, per listed run, its lines with steps above its start and
up to the next run's start (the last run's: up to the checkpoint's step).
"""
from __future__ import annotations

import json
from pathlib import Path

from rlstream.consumer.checkpoint.files import AUDIT, STATE, CheckpointManager, CheckpointState
from rlstream.consumer.logreplay import ReplayError


def newest_checkpoint(run_dir: Path) -> tuple[CheckpointState, Path]:
    """The newest committed checkpoint of the run in `run_dir` (its consumer.checkpoint_dir)."""
    latest = CheckpointManager(run_dir).latest() if Path(run_dir).is_dir() else None
    if latest is None:
        raise ReplayError(f"{run_dir} holds no committed checkpoint: a replay follows the lineage of one "
                          "(pass the run's consumer.checkpoint_dir as --run-dir)")
    return latest


def lineage_lines(run_dir: Path, st: CheckpointState, first: int, last: int) -> dict[int, dict]:
    """step -> its audit line, for steps first..last of the lineage of `st`. ReplayError when
    a step of that range has no line in the lineage, or two."""
    if not st.runs:
        raise ReplayError(f"the checkpoint of step {st.step} in {run_dir} lists no lineage (`runs`): "
                          "written by an rlstream before lineages; replay cannot tell which lines count")
    if not 0 <= first <= last <= st.step:
        raise ReplayError(f"steps {first}..{last} are not within the checkpoint's 0..{st.step}")
    starts = [s for _, s in st.runs] + [st.step]
    span = {run: (lo, hi) for (run, _), lo, hi in zip(st.runs, starts, starts[1:])}
    out: dict[int, dict] = {}
    path = Path(run_dir) / AUDIT
    if not path.is_file():
        raise ReplayError(f"{path} is missing: the audit log is what a replay follows")
    with open(path, "rb") as f:
        for raw in f:
            e = _parse(raw)
            if e is None or not first < e["step"] <= last:
                continue
            lo, hi = span.get(e.get("run"), (0, 0))
            if lo < e["step"] <= hi:
                if e["step"] in out:
                    raise ReplayError(f"step {e['step']} is logged twice by run {e['run']} in {path}")
                out[e["step"]] = e
    missing = sorted(set(range(first + 1, last + 1)) - set(out))
    if missing:
        raise ReplayError(f"the lineage {st.runs} has no audit line for steps {missing[:10]} in {path}")
    return out


def _parse(raw: bytes) -> dict | None:
    try:
        e = json.loads(raw)
    except ValueError:
        return None  # blank, or torn by a kill mid-write
    return e if isinstance(e, dict) and isinstance(e.get("step"), int) else None


def resume_floors(dirs: list[Path]) -> dict[int, int]:
    """partition -> the lowest offset a committed checkpoint in `dirs` (consumers' checkpoint
    directories) resumes from: the records a restart or a replay from any of them reads lie at
    or above it (a partition some checkpoint does not name: 0). ReplayError if none has one."""
    states = [CheckpointState.from_json((p / STATE).read_text())
              for d in dirs for p in sorted(Path(d).glob("step-*")) if (p / STATE).is_file()]
    if not states:
        raise ReplayError(f"no committed checkpoint in {[str(d) for d in dirs]}: pass consumers' checkpoint_dir")
    parts = {p for st in states for p in st.offsets}
    return {p: min(st.offsets.get(p, 0) for st in states) for p in parts}
