"""reasoning-gym tasks: items, prompts, the held-out/train split and the dataset's score.

    task = GymTask(settings)                  # producer.prompts {type: reasoning_gym, ...}
    split = task.split()                      # held-out items, then the training index range
    item = task.item(split.train_start + 7)   # GymItem(index, prompt, answer, entry)
    reward, info = task.score("19", item)     # the dataset's score_answer, in [0, 1]

reasoning-gym (PyPI, pinned in pyproject.toml's `tasks` extra) generates item
i of a dataset from `random.Random(seed + i)`: lazily, in any order, the same
items in every process (for the datasets it allows here). Hence:

- one seed, disjoint index ranges: seeds s and s+1 share almost all items, so
  the held-out items are the first `heldout` distinct prompts from index 0 and
  training uses the `size` indices after them (`Split`), skipping a prompt that
  is also held out. The producer serves the training range; the harness writes
  both to JSONL for the SFT warm start and the held-out evaluation.
- refused here, with the reason: datasets whose items depend on
  PYTHONHASHSEED (`HASH_SEED_DEPENDENT`: the producer and the harness would
  disagree on the split), `basic_arithmetic` without parentheses (0.1.25
  evaluates it left to right, ignoring precedence: `3+2*3` -> 15), and `seed`
  or `size` among the params (they are settings of their own).
- prompt formats: `question` is the dataset's question text as is (real
  models); `compact` renders a short prompt from the item's metadata
  (`COMPACT_FORMATS`, e.g. "12+7=", "gcd(75,5)="), which the tiny model's
  character vocabulary (common/tasks/arithmetic.py CHARS) can read: no question
  text fits it (every one has upper case).
- the score is the dataset's own `score_answer`: a float in [0, 1], binary for
  most datasets, partial credit for some (chain_sum gives "70" for 7 a 0.5),
  0 when it raises (some datasets do on malformed answers). `reward_info`
  carries `verifier`, `dataset`, `index`, `score` and `correct` (score == 1).

Importing reasoning-gym costs ~1.2 s and ~110 MB (it imports every dataset);
it happens when a `GymTask` is built, so nothing else pays it.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlstream.common.config import ReasoningGymPrompts
from rlstream.common.errors import ConfigError

HASH_SEED_DEPENDENT = frozenset({"codeio", "isomorphic_strings", "knight_swap", "polynomial_multiplication",
                                 "ransom_note", "word_ladder"})
"""Datasets whose items change with PYTHONHASHSEED in reasoning-gym 0.1.25 (measured)."""

_INSTALL = "pip install 'reasoning-gym==0.1.25' (rlstream's `tasks` extra, which `make install` installs)"


def _expression(e: dict) -> str:
    return e["metadata"]["expression"].replace(" ", "") + "="


def _call(name: str) -> Callable[[dict], str]:
    return lambda e: f"{name}(" + ",".join(str(n) for n in e["metadata"]["numbers"]) + ")="


COMPACT_FORMATS: dict[str, Callable[[dict], str]] = {
    "chain_sum": _expression,                                 # "4+3="
    "basic_arithmetic": _expression,                          # "(2*7)+-7="
    "products": _expression,                                  # "4*1="
    "gcd": _call("gcd"),                                      # "gcd(98,58)="
    "lcm": _call("lcm"),                                      # "lcm(4,16)="
    "number_sequence": lambda e: e["question"].replace(" ", ""),   # "5,2,1,0,?"
    "count_bits": lambda e: f"bits({e['metadata']['number']})=",  # "bits(35)="
}
"""Compact prompts from an item's metadata (answers are integers: digits and '-')."""


@dataclass(frozen=True)
class GymItem:
    index: int
    """The dataset index (item `index` of `dataset_seed`)."""
    prompt: str
    answer: str
    """The dataset's answer ("" for the few datasets that have none: only their scorer knows)."""
    entry: dict
    """The dataset's item (question, answer, metadata): what its scorer needs."""


@dataclass(frozen=True)
class Split:
    heldout: list[GymItem]
    """The first `heldout` distinct prompts from index 0."""
    train_start: int
    """First training index (just past the last index the held-out items looked at)."""
    heldout_prompts: frozenset[str]


class GymTask:
    """One reasoning-gym dataset as `producer.prompts` configures it (ConfigError if it cannot be)."""

    def __init__(self, settings: ReasoningGymPrompts):
        self.settings = s = settings
        self.name = s.dataset
        self._dataset = _create(s)
        self._format = self._prompt_format(s)

    @staticmethod
    def _prompt_format(s: ReasoningGymPrompts) -> Callable[[dict], str]:
        if s.prompt_format == "question":
            return lambda e: str(e["question"])
        if s.dataset not in COMPACT_FORMATS:
            raise ConfigError(f"dataset {s.dataset!r} has no compact prompt format; those that do: "
                              f"{', '.join(sorted(COMPACT_FORMATS))} (or use prompt_format: question)",
                              key="producer.prompts.prompt_format")
        return COMPACT_FORMATS[s.dataset]

    def item(self, index: int) -> GymItem:
        e = self._dataset[index]
        answer = e.get("answer")
        return GymItem(index, self._format(e), "" if answer is None else str(answer), e)

    def split(self) -> Split:
        """The held-out items and where training starts (deterministic for the settings)."""
        heldout, seen, i = [], set(), 0
        budget = 100 * self.settings.heldout + 1000
        while len(heldout) < self.settings.heldout:
            if i >= budget:
                raise ConfigError(f"only {len(heldout)} distinct prompts in the first {budget} items of "
                                  f"{self.name!r}; lower heldout or widen the dataset's params",
                                  key="producer.prompts.heldout")
            it = self.item(i)
            if it.prompt not in seen:
                seen.add(it.prompt)
                heldout.append(it)
            i += 1
        return Split(heldout, i, frozenset(seen))

    def score(self, response: str, item: GymItem) -> tuple[float, dict]:
        """The dataset's score of `response` for `item`, and the reward_info to record."""
        try:
            score = float(self._dataset.score_answer(answer=response, entry=item.entry))
        except Exception as e:  # noqa: BLE001 - some scorers raise on malformed answers: that is a wrong answer
            return 0.0, self._info(item, 0.0, error=type(e).__name__)
        if not math.isfinite(score):
            score = 0.0
        return score, self._info(item, score)

    def _info(self, item: GymItem, score: float, **extra) -> dict:
        return {"verifier": "reasoning_gym", "dataset": self.name, "index": item.index, "score": score,
                "correct": score >= 1.0, **extra}


def _create(s: ReasoningGymPrompts):
    """The reasoning-gym dataset object; ConfigError naming the setting that is wrong."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(f"producer.prompts type reasoning_gym needs reasoning-gym: {_INSTALL}",
                          key="producer.prompts.type") from None
    _check(s, DATASETS)
    size = s.size + 100 * s.heldout + 1000  # only bounds iteration: items are generated by index
    try:
        return reasoning_gym.create_dataset(s.dataset, seed=s.dataset_seed, size=size, **s.params)
    except (AssertionError, TypeError, ValueError) as e:  # its configs validate with assert
        raise ConfigError(f"reasoning-gym refused the params of {s.dataset!r}: {e or type(e).__name__}",
                          key="producer.prompts.params") from None


def _check(s: ReasoningGymPrompts, datasets: dict[str, Any]) -> None:
    if s.dataset not in datasets:
        close = difflib.get_close_matches(s.dataset, list(datasets), n=3)
        raise ConfigError(f"unknown reasoning-gym dataset {s.dataset!r}"
                          + (f"; did you mean {', '.join(close)}?" if close else "")
                          + f" ({len(datasets)} datasets: reasoning_gym.factory.DATASETS)",
                          key="producer.prompts.dataset")
    if s.dataset in HASH_SEED_DEPENDENT:
        raise ConfigError(f"{s.dataset!r} generates different items under different PYTHONHASHSEED "
                          "(reasoning-gym 0.1.25), so its held-out split is not reproducible; choose "
                          "another dataset", key="producer.prompts.dataset")
    if set(s.params) & {"seed", "size"}:
        raise ConfigError("seed and size are settings of their own: use producer.prompts.dataset_seed "
                          "and producer.prompts.size", key="producer.prompts.params")
    if s.dataset == "basic_arithmetic" and s.params.get("allow_parentheses") is False:
        raise ConfigError("basic_arithmetic without parentheses has wrong answers in reasoning-gym 0.1.25 "
                          "(evaluated left to right: 3+2*3 -> 15); keep allow_parentheses true or use "
                          "chain_sum / products", key="producer.prompts.params")
