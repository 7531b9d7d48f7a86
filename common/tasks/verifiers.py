"""Pluggable reward functions: `(response_text, answer) -> (reward, info)`.

Rewards are binary (1.0 correct, 0.0 otherwise); `info` is a small dict of
str/int/float/bool values that travels in the record's `reward_info`.

- `exact_match`: the response stripped of surrounding whitespace equals the
  answer (the tiny arithmetic task of common/tasks/arithmetic.py).
- `math`: math-verify (Hugging Face, pinned in pyproject.toml) decides whether
  the response and the answer denote the same mathematical object: values,
  fractions, LaTeX, expressions ("0.5" == "1/2" == "\\boxed{\\frac{2}{4}}",
  "\\boxed{x + 1}" == "x+1"), reading the answer out of text ("the answer is
  7"). It runs in a worker process whose own timeouts cannot reach this one
  (common/tasks/mathjudge.py: why, how, and what it costs per call).

Select by name with `get_verifier(name)`; add one with `register_verifier`.
A reasoning-gym prompt source scores with the dataset's own function instead
(producer/prompts.py binds it as the prompt's `Task.score`).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable

from rlstream.common.errors import ConfigError
from rlstream.common.tasks.mathjudge import MathJudge

Verifier = Callable[[str, str], "tuple[float, dict]"]
_REGISTRY: dict[str, Verifier] = {}


def register_verifier(name: str, fn: Verifier) -> Verifier:
    """Make `fn` selectable as `get_verifier(name)` (e.g. from a plugin module)."""
    _REGISTRY[name] = fn
    return fn


def get_verifier(name: str) -> Verifier:
    """The verifier called `name`; ConfigError listing the known names otherwise
    (or saying what to install, for `math` without math-verify)."""
    try:
        fn = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown verifier {name!r}; choose one of {sorted(_REGISTRY)}",
                          key="producer.verifier") from None
    if name == "math" and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("the math verifier needs math-verify: pip install 'math-verify[antlr4_13_2]==0.9.0' "
                          "(an rlstream dependency; `make install` installs it)", key="producer.verifier")
    return fn


def verifier_names() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------
# exact match
# ---------------------------------------------------------------------------
def exact_match(response: str, answer: str) -> tuple[float, dict]:
    got, want = response.strip(), answer.strip()
    ok = got == want
    return (1.0 if ok else 0.0), {"verifier": "exact_match", "parsed": got[:64], "correct": ok}


# ---------------------------------------------------------------------------
# math answers: math-verify, in its worker process (common/tasks/mathjudge.py)
# ---------------------------------------------------------------------------
_JUDGE = MathJudge()


def math_answer(response: str, answer: str) -> tuple[float, dict]:
    ok, parsed = _JUDGE(response, answer)
    return (1.0 if ok else 0.0), {"verifier": "math", "parsed": parsed[:64], "correct": ok}


register_verifier("exact_match", exact_match)
register_verifier("math", math_answer)
