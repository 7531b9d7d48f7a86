"""The prompt sources (producer/prompts.py): the JSONL source reading the toy
task's files, and the reasoning-gym source (real reasoning-gym 0.1.25)."""
import json

import pytest

from rlstream.common.config import JsonlPrompts, KafkaSettings, ReasoningGymPrompts, load_config
from rlstream.common.errors import ConfigError
from rlstream.common.tasks import arithmetic as tasks
from rlstream.producer.prompts import GymPromptSource, JsonlPromptSource, open_prompt_source
from rlstream.common.tasks.verifiers import get_verifier


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
    assert all(rows[p.task.prompt] == p.task.reference for p in e0)


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
    assert (p.prompt_id, p.task.prompt, p.task.reference, p.epoch) == ("q7", "2+2=", "4", 0)


def test_open_prompt_source_builds_the_configured_jsonl_source(tmp_path):
    path = tasks.write_jsonl(tmp_path / "t.jsonl", 10, seed=0)
    src = open_prompt_source(JsonlPrompts(path=str(path), seed=5), KafkaSettings())
    assert isinstance(src, JsonlPromptSource) and src.seed == 5 and len(src) == 10
    assert [src.take().prompt_id for _ in range(10)] == [p.prompt_id for p in JsonlPromptSource(path, seed=5,
                                                                                                 epochs=1)]
    with pytest.raises(ConfigError) as e:
        open_prompt_source(JsonlPrompts(path=str(tmp_path / "missing.jsonl")), KafkaSettings())
    assert e.value.key == "producer.prompts.path"


# ---------------------------------------------------------------------------- reasoning-gym

def gym_settings(**kw) -> ReasoningGymPrompts:
    return ReasoningGymPrompts(**{"dataset": "chain_sum", "prompt_format": "compact", "size": 40, "heldout": 32,
                                  "params": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), **kw})


def test_gym_source_cycles_reshuffles_and_never_serves_a_heldout_prompt():
    src = open_prompt_source(gym_settings(seed=5), KafkaSettings())
    assert isinstance(src, GymPromptSource)
    heldout = src.split.heldout_prompts
    both = list(GymPromptSource(gym_settings(seed=5), epochs=2))
    e0, e1 = [p for p in both if p.epoch == 0], [p for p in both if p.epoch == 1]
    # 1-digit sums: few distinct prompts, so the held-out ones recur in the training range and are skipped
    skipped = [i for i in src.epoch_order(0) if src.task.item(i).prompt in heldout]
    assert skipped and len(e0) == 40 - len(skipped) == len(e1)
    assert not {p.task.prompt for p in e0 + e1} & heldout
    assert sorted(p.prompt_id for p in e0) == sorted(p.prompt_id for p in e1)
    assert [p.prompt_id for p in e0] != [p.prompt_id for p in e1]  # reshuffled
    other = [p.prompt_id for p in GymPromptSource(gym_settings(seed=6), epochs=1)]
    assert other != [p.prompt_id for p in e0] and sorted(other) == sorted(p.prompt_id for p in e0)
    p = e0[0]
    _, seed, index = p.prompt_id.split(":")
    assert p.prompt_id.startswith("chain_sum:0:") and int(index) >= src.split.train_start
    assert eval(p.task.prompt[:-1]) == int(p.task.reference)  # noqa: S307


def test_gym_source_takes_in_the_order_it_iterates():
    a = GymPromptSource(gym_settings(seed=3))
    b = list(GymPromptSource(gym_settings(seed=3), epochs=1))
    assert [(x.prompt_id, x.task.prompt, x.task.reference) for x in (a.take() for _ in b)] ==\
        [(x.prompt_id, x.task.prompt, x.task.reference) for x in b]


def test_gym_prompts_score_with_the_dataset_or_the_verifier():
    p = next(iter(GymPromptSource(gym_settings())))
    reward, info = p.task.score(p.task.reference)
    assert reward == 1.0 and info["dataset"] == "chain_sum" and info["verifier"] == "reasoning_gym"
    assert p.task.score("zz")[0] == 0.0
    exact = get_verifier("exact_match")
    q = next(iter(GymPromptSource(gym_settings(reward="verifier"), exact)))
    assert q.task.score(q.task.reference) == exact(q.task.reference, q.task.reference) and q.task.score(q.task.reference + "0")[0] == 0.0
    with pytest.raises(ConfigError) as e:
        GymPromptSource(gym_settings(reward="verifier"))
    assert e.value.key == "producer.prompts.reward"
    no_answers = gym_settings(dataset="graph_color", params={}, prompt_format="question", reward="verifier")
    with pytest.raises(ConfigError, match="no answer") as e:
        GymPromptSource(no_answers, exact)
    assert e.value.key == "producer.prompts.reward"
    r = next(iter(GymPromptSource(no_answers.model_copy(update={"reward": "dataset"}))))
    assert r.task.reference == "" and 0.0 <= r.task.score("x")[0] <= 1.0  # only its scorer judges it


def test_gym_source_with_every_training_prompt_held_out_is_refused():
    src = GymPromptSource(gym_settings(size=1, heldout=90))
    with pytest.raises(ConfigError, match="also held out") as e:
        list(src)
    assert e.value.key == "producer.prompts.size"


def test_reasoning_gym_prompts_in_the_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("producer:\n  prompts: {type: reasoning_gym, dataset: gcd, params: {max_value: 99}, seed: 2}\n")
    p = load_config(f, environ={}).producer.prompts
    assert isinstance(p, ReasoningGymPrompts) and p.params == {"max_value": 99} and p.prompt_format == "question"
    with pytest.raises(ConfigError) as e:
        load_config(f, ["producer.prompts.prompt_format=tiny"], environ={})
    assert e.value.key == "producer.prompts.prompt_format"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["producer.prompts.dataset=gcd"], environ={})  # no type: not a jsonl key
    assert "reasoning_gym" in str(e.value)
