"""Prompt sources for the producer: an endless, seeded stream of `Prompt`s.

`JsonlPromptSource(path, seed)` reads a JSONL file of `{"prompt": ..., "answer": ...}`
lines (the format common/tasks.py writes), validates every line up front (a
bad file fails at startup, naming the line), and then cycles over it epoch
after epoch, reshuffling each epoch with a generator seeded by (seed, epoch):
the order is reproducible and independent of how far a previous run got.

The Kafka prompt topic (`producer.prompt_topic` in common/config.py) is the
other implementation of the same seam, `PromptSource`: anything iterable
over `Prompt`s can feed the service loop.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    """Stable id: the row's "id" field if present, else "<file name>:<line number>"."""
    text: str
    answer: str
    epoch: int


class PromptSource(Protocol):
    """What the service loop needs: an iterator of prompts (endless or not)."""

    def __iter__(self) -> Iterator[Prompt]: ...


class JsonlPromptSource:
    """Cycles over a JSONL prompt file, reshuffled every epoch with `seed`.

    `epochs=None` cycles forever; `start_epoch` resumes the order at an epoch.
    """

    def __init__(self, path: str | os.PathLike, seed: int = 0, epochs: int | None = None,
                 start_epoch: int = 0, shuffle: bool = True):
        self.path = Path(path)
        self.seed = int(seed)
        self.epochs = epochs
        self.start_epoch = int(start_epoch)
        self.shuffle = shuffle
        self.rows = load_prompt_rows(self.path)

    def __len__(self) -> int:
        return len(self.rows)

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` yields them."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[Prompt]:
        epoch = self.start_epoch
        while self.epochs is None or epoch < self.start_epoch + self.epochs:
            for i in self.epoch_order(epoch):
                pid, text, answer = self.rows[i]
                yield Prompt(pid, text, answer, epoch)
            epoch += 1


def load_prompt_rows(path: Path) -> list[tuple[str, str, str]]:
    """[(prompt_id, prompt, answer)] of every non-blank line; ConfigError naming the bad line."""
    if not path.is_file():
        raise ConfigError(f"prompt file {str(path)!r} does not exist; write one with "
                          "`python -m common.tasks TRAIN HELDOUT`", key="producer.prompts_path")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg})", key="producer.prompts_path") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: expected a JSON object with 'prompt' and 'answer'",
                                  key="producer.prompts_path")
            prompt, answer = row.get("prompt"), row.get("answer")
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(f"{where}: 'prompt' must be a non-empty string", key="producer.prompts_path")
            if answer is None or isinstance(answer, (dict, list, bool)):
                raise ConfigError(f"{where}: 'answer' must be a string or a number", key="producer.prompts_path")
            pid = str(row["id"]) if "id" in row else f"{path.name}:{lineno}"
            rows.append((pid, prompt, str(answer)))
    if not rows:
        raise ConfigError(f"prompt file {str(path)!r} has no prompts", key="producer.prompts_path")
    return rows
