"""The toy arithmetic task (common/tasks/arithmetic.py): problems and their files."""
import json

import pytest

from rlstream.common.errors import ConfigError
from rlstream.common.tasks import arithmetic as tasks
from rlstream.common.tasks.arithmetic import CHARS
from rlstream.common.tasks.verifiers import get_verifier


def test_problems_are_correct_reproducible_and_in_the_charset():
    a = tasks.generate(500, seed=3)
    assert a == tasks.generate(500, seed=3)
    assert a != tasks.generate(500, seed=4)
    assert len({p.prompt for p in a}) == 500
    for p in a:
        assert set(p.prompt) <= set(CHARS) and p.prompt.endswith("=")
        assert eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307 - digits and +- only
        assert set(p.answer) <= set(CHARS)


def test_difficulty_knobs():
    spec = tasks.TaskSpec(max_operand=9, num_terms=3, ops="+", allow_negative=False)
    for p in tasks.generate(200, seed=0, spec=spec):
        terms = p.prompt[:-1].split("+")
        assert len(terms) == 3 and all(0 <= int(t) <= 9 for t in terms)
    for p in tasks.generate(200, seed=0, spec=tasks.TaskSpec(ops="-", allow_negative=False)):
        assert int(p.answer) >= 0
    with pytest.raises(ConfigError, match="at most"):
        tasks.generate(1000, seed=0, spec=tasks.TaskSpec(max_operand=3))
    with pytest.raises(ConfigError):
        tasks.generate(1, seed=0, spec=tasks.TaskSpec(ops="*"))


def test_write_splits_are_disjoint_jsonl(tmp_path):
    train, held = tasks.write_splits(tmp_path / "train.jsonl", tmp_path / "held.jsonl", 300, 50, seed=1)
    tr = [json.loads(x) for x in train.read_text().splitlines()]
    he = [json.loads(x) for x in held.read_text().splitlines()]
    assert len(tr) == 300 and len(he) == 50
    assert set(tr[0]) == {"prompt", "answer"}
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in he}
    verify = get_verifier("exact_match")
    assert all(verify(r["answer"], r["answer"])[0] == 1.0 for r in tr)
    assert tasks.is_correct(" 19\n", "19") and not tasks.is_correct("18", "19")


def test_write_jsonl(tmp_path):
    p = tasks.write_jsonl(tmp_path / "x" / "t.jsonl", 20, seed=0)
    assert len(p.read_text().splitlines()) == 20


def test_read_problems_is_the_inverse_of_write_problems(tmp_path):
    problems = tasks.generate(30, seed=2)
    path = tasks.write_problems(tmp_path / "t.jsonl", problems)
    assert tasks.read_problems(path) == problems
    assert tasks.read_problems(path, limit=7) == problems[:7]
    path.write_text(path.read_text() + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(ConfigError, match=r"t\.jsonl:32 .*'answer'"):
        tasks.read_problems(path)
