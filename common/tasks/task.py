"""One `Task`: what a group of rollouts works on, bound where the prompt comes from.

A prompt source (producer/prompts.py) binds each prompt's score once: the
dataset's own (reasoning-gym) or `producer.verifier` against its reference
answer (`Task.checked_by`). Single-turn scoring, environments (the calculator
scores its final answer with `task.score`) and black-box agents (a `verified`
end) then call `task.score(text)` and never look up a verifier themselves.
Two tasks are equal when their prompt and reference are (a score is a
function: a rebound one never compares equal).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Score = Callable[[str], "tuple[float, dict]"]
"""A response text -> (reward, reward_info); reward_info: str/int/float/bool values."""


@dataclass(frozen=True)
class Task:
    prompt: str
    """The prompt text (an environment's reset may render it further)."""
    reference: str
    """The reference answer ("" when only the dataset's scorer can judge, or an agent brought none)."""
    score: Score | None = field(compare=False)
    """The task's reward of a final answer text; None only for an agent's own prompt without an
    answer (the agent reports the reward)."""

    @classmethod
    def checked_by(cls, verify: Callable[[str, str], tuple[float, dict]], prompt: str, reference: str) -> Task:
        """A task scored by `verify(text, reference)` (common/tasks/verifiers.py)."""
        return cls(prompt, reference, lambda text: verify(text, reference))
