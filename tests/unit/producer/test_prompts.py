"""The JSONL prompt source (producer/prompts.py), reading the toy task's files."""
import json

import pytest

from common.config import JsonlPrompts, KafkaSettings
from common.errors import ConfigError
from common.toy import tasks
from producer.prompts import JsonlPromptSource, open_prompt_source
from producer.verifiers import get_verifier


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


def test_open_prompt_source_builds_the_configured_jsonl_source(tmp_path):
    path = tasks.write_jsonl(tmp_path / "t.jsonl", 10, seed=0)
    src = open_prompt_source(JsonlPrompts(path=str(path), seed=5), KafkaSettings())
    assert isinstance(src, JsonlPromptSource) and src.seed == 5 and len(src) == 10
    assert [src.take().prompt_id for _ in range(10)] == [p.prompt_id for p in JsonlPromptSource(path, seed=5,
                                                                                                 epochs=1)]
    with pytest.raises(ConfigError) as e:
        open_prompt_source(JsonlPrompts(path=str(tmp_path / "missing.jsonl")), KafkaSettings())
    assert e.value.key == "producer.prompts.path"
