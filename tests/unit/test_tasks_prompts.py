"""The arithmetic task files and the JSONL prompt source."""
import json

import pytest

from common.toy import tasks
from common.errors import ConfigError
from common.toy.tinymodel import CHARS
from producer.prompts import JsonlPromptSource
from producer.verifiers import get_verifier


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


def test_prompt_source_cycles_and_reshuffles_each_epoch(tmp_path):
    path = tasks.write_jsonl(tmp_path / "t.jsonl", 30, seed=0)
    src = JsonlPromptSource(path, seed=5)
    it = iter(src)
    e0 = [next(it) for _ in range(30)]
    e1 = [next(it) for _ in range(30)]
    assert {p.epoch for p in e0} == {0} and {p.epoch for p in e1} == {1}
    assert sorted(p.prompt_id for p in e0) == sorted(p.prompt_id for p in e1)
    assert [p.prompt_id for p in e0] != [p.prompt_id for p in e1]  # reshuffled
    again = list(JsonlPromptSource(path, seed=5, epochs=2))
    assert again == e0 + e1  # reproducible from the seed
    other = list(JsonlPromptSource(path, seed=6, epochs=1))
    assert [p.prompt_id for p in other] != [p.prompt_id for p in e0]
    resumed = list(JsonlPromptSource(path, seed=5, epochs=1, start_epoch=1))
    assert resumed == e1
    rows = {json.loads(x)["prompt"]: json.loads(x)["answer"] for x in path.read_text().splitlines()}
    assert all(rows[p.text] == p.answer for p in e0)


def test_prompt_source_errors_name_the_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        JsonlPromptSource(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4}\n{"prompt": "3+3="\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:4: not valid JSON"):
        JsonlPromptSource(bad)
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: 'prompt'"):
        JsonlPromptSource(bad)
    bad.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: 'answer'"):
        JsonlPromptSource(bad)
    bad.write_text('[1, 2]\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: expected a JSON object"):
        JsonlPromptSource(bad)
    bad.write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        JsonlPromptSource(bad)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "2+2=", "answer": 4, "id": "q7"}\n')
    (p,) = list(JsonlPromptSource(ok, epochs=1))
    assert (p.prompt_id, p.text, p.answer, p.epoch) == ("q7", "2+2=", "4", 0)
