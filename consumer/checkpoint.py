"""Atomic checkpoints: model, optimizer, version and Kafka offsets together.

    <dir>/step-00000012/trainer.pt    model + optimizer state (torch.save, loaded
                                      with weights_only=True: tensors and plain data)
    <dir>/step-00000012/state.json    version, offsets, processed rollout ids, counters

A checkpoint is written under a temporary name, every file fsynced, the
directory renamed into place and its parent fsynced. A directory without
`state.json` is never considered complete. `latest()` returns the newest
complete one; the newest `keep` are kept.

Offsets are the consumer's commit: Kafka offsets are never committed to the
broker, only here, together with the weights they produced. On restart the
reader seeks to `offsets` and the assembler skips the ids in `processed`, so each
record is trained at most once.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.fsutil import commit_dir, staging_dir

STATE = "state.json"
TRAINER = "trainer.pt"


@dataclass
class CheckpointState:
    step: int
    version: int
    offsets: dict[int, int]  # partition -> next offset to read on restart
    # [partition, offset, rollout_id] of records at or above `offsets` that were
    # already processed (trained, dropped, ...): skipped when re-read.
    processed: list[list] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointState":
        d = json.loads(text)
        d["offsets"] = {int(k): int(v) for k, v in d["offsets"].items()}
        return cls(**d)


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root = Path(root)
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)

    def _complete(self) -> list[Path]:
        return sorted(p for p in self.root.glob("step-*") if (p / STATE).is_file())

    def save(self, state: CheckpointState, trainer_state: dict[str, Any]) -> Path:
        import torch

        final = self.root / f"step-{state.step:08d}"
        tmp = staging_dir(final)
        torch.save(trainer_state, tmp / TRAINER)
        (tmp / STATE).write_text(json.dumps(asdict(state)))
        commit_dir(tmp, final)
        for old in self._complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stray in self.root.glob(".step-*.tmp-*"):  # left by a crash mid-write
            if stray != tmp:
                shutil.rmtree(stray, ignore_errors=True)
        return final

    def latest(self) -> tuple[CheckpointState, Path] | None:
        done = self._complete()
        if not done:
            return None
        p = done[-1]
        return CheckpointState.from_json((p / STATE).read_text()), p

    @staticmethod
    def load_trainer_state(path: Path) -> dict[str, Any]:
        import torch

        return torch.load(path / TRAINER, map_location="cpu", weights_only=True)
