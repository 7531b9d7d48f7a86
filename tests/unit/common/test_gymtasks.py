"""reasoning-gym tasks (common/tasks/reasoning_gym.py), with the real reasoning-gym 0.1.25:
compact prompts in the tiny model's characters with right answers, a held-out
split that is reproducible across processes and disjoint from training, the
dataset's score as the reward, and refusals that name the setting."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlstream.common.config import ReasoningGymPrompts
from rlstream.common.errors import ConfigError
from rlstream.common.tasks.reasoning_gym import COMPACT_FORMATS, HASH_SEED_DEPENDENT, GymTask
from rlstream.common.tasks.arithmetic import CHARS

# small params per dataset: the sizes the tiny model can learn
TINY_PARAMS = {
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
    "basic_arithmetic": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2, operators=["+", "-", "*"],
                             allow_parentheses=True, whitespace="no_space"),
    "products": dict(min_digits=1, max_digits=2),
    "gcd": dict(min_value=1, max_value=99),
    "lcm": dict(min_value=1, max_value=20),
    "number_sequence": dict(min_terms=4, max_terms=6, min_value=-20, max_value=20, max_complexity=1),
    "count_bits": dict(max_n=255),
}


def task(dataset="chain_sum", **kw) -> GymTask:
    kw.setdefault("params", TINY_PARAMS.get(dataset, {}))
    kw.setdefault("prompt_format", "compact")
    return GymTask(ReasoningGymPrompts(dataset=dataset, **kw))


def test_every_compact_format_is_tested_here():
    assert set(COMPACT_FORMATS) == set(TINY_PARAMS)


@pytest.mark.parametrize("dataset", sorted(TINY_PARAMS))
def test_compact_prompts_fit_the_tiny_vocabulary_and_score_their_answer(dataset):
    t = task(dataset)
    for i in range(300):
        it = t.item(i)
        assert set(it.prompt + it.answer) <= set(CHARS), (it.prompt, it.answer)
        assert t.score(it.answer, it)[0] == 1.0
    if dataset in ("chain_sum", "basic_arithmetic", "products"):
        # the answers are the expressions' values (precedence included: allow_parentheses stays on)
        for i in range(300):
            it = t.item(i)
            assert it.prompt.endswith("=") and eval(it.prompt[:-1]) == int(it.answer), it.prompt  # noqa: S307


def test_question_format_is_the_dataset_text():
    t = task("chain_sum", prompt_format="question")
    it = t.item(0)
    assert it.prompt == it.entry["question"] and it.prompt.startswith("State the final answer")


def test_split_is_distinct_disjoint_and_reproducible():
    t = task(heldout=64)
    s = t.split()
    prompts = [it.prompt for it in s.heldout]
    assert len(prompts) == 64 == len(set(prompts)) and s.heldout_prompts == frozenset(prompts)
    assert s.train_start == s.heldout[-1].index + 1
    assert [it.index for it in s.heldout] == sorted(it.index for it in s.heldout)
    again = task(heldout=64).split()
    assert [it.prompt for it in again.heldout] == prompts and again.train_start == s.train_start
    other_seed = task(heldout=64, dataset_seed=1).split()
    assert [it.prompt for it in other_seed.heldout] != prompts


def test_split_is_the_same_under_another_hash_seed():
    code = ("import json; from rlstream.common.config import ReasoningGymPrompts as R; from rlstream.common.tasks.reasoning_gym import GymTask;"
            "s = GymTask(R(dataset='chain_sum', params=%r, prompt_format='compact', heldout=32)).split();"
            "print(json.dumps([s.train_start, [i.prompt for i in s.heldout]]))" % TINY_PARAMS["chain_sum"])
    outs = []
    for hs in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hs}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]


def test_too_few_distinct_prompts_refused_by_split():
    t = task("products", params=dict(min_digits=1, max_digits=1), heldout=200)
    with pytest.raises(ConfigError, match="distinct prompts") as e:
        t.split()
    assert e.value.key == "producer.prompts.heldout"


def test_score_is_the_datasets_with_partial_credit_and_details():
    t = task("chain_sum")
    it = t.item(0)
    assert t.score(it.answer, it) == (1.0, {"verifier": "reasoning_gym", "dataset": "chain_sum",
                                            "index": it.index, "score": 1.0, "correct": True})
    reward, info = t.score(it.answer + "0", it)  # chain_sum's partial credit for a wrong answer
    assert 0.0 < reward < 1.0 and info["score"] == reward and info["correct"] is False
    assert t.score("", it)[0] == 0.0
    assert all(isinstance(v, (str, int, float, bool)) for v in info.values())


def test_a_scorer_that_raises_scores_zero():
    t = task("prime_factorization", params={}, prompt_format="question")
    it = t.item(0)
    reward, info = t.score("abc", it)  # 0.1.25's scorer raises ValueError on this
    assert reward == 0.0 and info["correct"] is False and info["error"]


@pytest.mark.parametrize("changes,key,match", [
    (dict(dataset="chain_summ"), "producer.prompts.dataset", "did you mean chain_sum"),
    (dict(dataset=sorted(HASH_SEED_DEPENDENT)[0], prompt_format="question", params={}),
     "producer.prompts.dataset", "PYTHONHASHSEED"),
    (dict(params={"seed": 3}), "producer.prompts.params", "dataset_seed"),
    (dict(params={"size": 3}), "producer.prompts.params", "producer.prompts.size"),
    (dict(dataset="basic_arithmetic", params={"allow_parentheses": False}), "producer.prompts.params",
     "left to right"),
    (dict(params={"min_terms": 0}), "producer.prompts.params", "refused the params"),
    (dict(params={"no_such_param": 1}), "producer.prompts.params", "refused the params"),
    (dict(dataset="sudoku", params={}), "producer.prompts.prompt_format", "no compact prompt format"),
])
def test_refusals_name_the_setting(changes, key, match):
    with pytest.raises(ConfigError, match=match) as e:
        task(**changes)
    assert e.value.key == key
