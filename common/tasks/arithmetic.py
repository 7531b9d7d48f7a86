"""The verifiable toy task: small-number arithmetic ("12+7=" -> "19").

Prompts use only characters of `CHARS`, the alphabet the tiny tokenizer (ops/toy/tinymodel.py) is built on:
digits, '+', '-' and '='. The answer is the exact integer result (negative
results keep their '-'). Problems are generated from a seed, so a task file
is reproducible; `write_splits` writes a train file and a held-out file with
disjoint prompts; `read_problems` reads one back, `is_correct` is the check.

    python -m rlstream.common.tasks.arithmetic data/train.jsonl data/heldout.jsonl --n-train 4096 --n-heldout 256

Difficulty knobs (`TaskSpec`): operand range, number of terms, operators,
and whether negative results are allowed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from rlstream.common.errors import ConfigError

CHARS = list("0123456789+-*/=?: abcdefghijklmnopqrstuvwxyz.,()")
"""The alphabet of the toy world: every prompt and answer is written in it."""


@dataclass(frozen=True)
class TaskSpec:
    """Difficulty of the arithmetic task."""

    min_operand: int = 0
    max_operand: int = 99
    """Operands are drawn uniformly from [min_operand, max_operand]."""
    num_terms: int = 2
    """Number of operands per problem (2 -> "a+b=", 3 -> "a+b-c=")."""
    ops: str = "+-"
    """Operators to draw from (subset of "+-")."""
    allow_negative: bool = True
    """If False, problems with a negative result are redrawn."""

    def validate(self) -> "TaskSpec":
        if not 0 <= self.min_operand <= self.max_operand:
            raise ConfigError("need 0 <= min_operand <= max_operand", key="task.max_operand")
        if self.num_terms < 2:
            raise ConfigError("need at least 2 terms", key="task.num_terms")
        if not self.ops or set(self.ops) - set("+-"):
            raise ConfigError("ops must be a non-empty subset of '+-'", key="task.ops")
        return self

    @property
    def num_distinct(self) -> int:
        """Upper bound on distinct prompts (operand and operator choices)."""
        k = self.max_operand - self.min_operand + 1
        return k ** self.num_terms * len(set(self.ops)) ** (self.num_terms - 1)


@dataclass(frozen=True)
class Problem:
    """One task item: the prompt text and its exact answer (also a JSONL row)."""

    prompt: str
    answer: str


def make_problem(rng: random.Random, spec: TaskSpec = TaskSpec()) -> Problem:
    """One problem drawn with `rng`."""
    while True:
        terms = [rng.randint(spec.min_operand, spec.max_operand) for _ in range(spec.num_terms)]
        ops = [rng.choice(spec.ops) for _ in range(spec.num_terms - 1)]
        value = terms[0]
        text = str(terms[0])
        for op, t in zip(ops, terms[1:]):
            value = value + t if op == "+" else value - t
            text += f"{op}{t}"
        if value >= 0 or spec.allow_negative:
            return Problem(text + "=", str(value))


def generate(n: int, seed: int, spec: TaskSpec = TaskSpec(), exclude: set[str] | None = None) -> list[Problem]:
    """`n` distinct problems (by prompt), reproducible from `seed`, none in `exclude`."""
    spec.validate()
    exclude = exclude or set()
    if n + len(exclude) > spec.num_distinct:
        raise ConfigError(f"{n} distinct problems requested but the spec allows at most "
                          f"{spec.num_distinct - len(exclude)}; widen max_operand or num_terms", key="task")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    attempts = 0
    while len(out) < n:
        p = make_problem(rng, spec)
        attempts += 1
        if attempts > 100 * (n + 10):
            raise ConfigError(f"could only draw {len(out)} distinct problems of {n}; widen the spec", key="task")
        if p.prompt in seen:
            continue
        seen.add(p.prompt)
        out.append(p)
    return out


def split(problems: list[Problem], n_heldout: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): the last `n_heldout` problems are held out (prompts are distinct)."""
    if not 0 <= n_heldout <= len(problems):
        raise ConfigError(f"n_heldout {n_heldout} not in [0, {len(problems)}]", key="task.n_heldout")
    cut = len(problems) - n_heldout
    return problems[:cut], problems[cut:]


def write_problems(path: str | os.PathLike, problems: list[Problem]) -> Path:
    """Write JSONL lines {"prompt": ..., "answer": ...} (atomically: tmp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    os.replace(tmp, path)
    return path


def read_problems(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """The problems of a task file (JSONL rows with `prompt` and `answer`), in
    order, at most `limit`; ConfigError naming the line of a malformed row."""
    out: list[Problem] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(Problem(str(row["prompt"]), str(row["answer"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{lineno} is not a task row with 'prompt' and 'answer' ({e!r}); "
                                  "write task files with `python -m rlstream.common.tasks.arithmetic`") from None
    return out


def write_jsonl(path: str | os.PathLike, n: int, seed: int, spec: TaskSpec = TaskSpec()) -> Path:
    """Write `n` problems from `seed` to `path` (JSONL with `prompt` and `answer`)."""
    return write_problems(path, generate(n, seed, spec))


def write_splits(train_path: str | os.PathLike, heldout_path: str | os.PathLike, n_train: int,
                 n_heldout: int, seed: int, spec: TaskSpec = TaskSpec()) -> tuple[Path, Path]:
    """Write disjoint train and held-out files drawn from one seeded stream."""
    train, heldout = split(generate(n_train + n_heldout, seed, spec), n_heldout)
    return write_problems(train_path, train), write_problems(heldout_path, heldout)


def is_correct(response: str, answer: str) -> bool:
    """The task's check, exact match: the response, stripped of surrounding
    whitespace, is the answer. Held-out evaluation (ops/harness/evaluate.py)
    uses it; it is the same rule as the producer's `exact_match` verifier."""
    return response.strip() == answer.strip()


def uses_tokenizer_chars(text: str) -> bool:
    """True if every character is in the tiny tokenizer's vocabulary."""
    return set(text) <= set(CHARS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("train")
    ap.add_argument("heldout")
    ap.add_argument("--n-train", type=int, default=4096)
    ap.add_argument("--n-heldout", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=TaskSpec.max_operand)
    ap.add_argument("--num-terms", type=int, default=TaskSpec.num_terms)
    ap.add_argument("--ops", default=TaskSpec.ops)
    ap.add_argument("--no-negative", action="store_true")
    a = ap.parse_args(argv)
    spec = TaskSpec(max_operand=a.max_operand, num_terms=a.num_terms, ops=a.ops, allow_negative=not a.no_negative)
    for p in write_splits(a.train, a.heldout, a.n_train, a.n_heldout, a.seed, spec):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
