"""The environment protocol of multi-turn episodes (docs/multi-turn.md).

An environment (common/tasks/envs/) follows `Environment`:

    observation = env.reset(task)                            # text: the prompt
    result = env.step(ModelTurn(text, token_ids, finish))    # StepResult(observation, reward, done, info)

The episode runner (producer/rollout/episodes.py) calls both on its thread
pool with a deadline; the Hugging Face evaluation loop
(ops/harness/tool_eval.py) calls them directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rlstream.common.tasks.task import Task


@dataclass(frozen=True)
class ModelTurn:
    text: str
    """The turn's tokens decoded (special tokens skipped): what the environment parses."""
    token_ids: tuple[int, ...]
    finish_reason: str
    """The engine's: "stop" (a stop token or EOS, included in token_ids) or "length"."""


@dataclass(frozen=True)
class StepResult:
    observation: str | None
    """Text appended before the next model turn; None (or done) ends the episode."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    stop_texts: tuple[str, ...]
    """Texts that end a model turn (each one token of the model's vocabulary), besides EOS."""
    # Optional `resumable = True`: reset(task) then step() with the episode's model turns, in
    # order, rebuilds the environment's state (a journaled episode resumes: producer/journal/).

    def reset(self, task: Task) -> str: ...

    def step(self, turn: ModelTurn) -> StepResult: ...
