"""The tool_use experiment's pieces: the calculator's worked solutions, the tool-format
SFT examples, held-out episodes with the tool (ops/harness/tool_eval.py) driven by
a scripted model, and the experiment's arms and report. The whole pipeline (real
vLLM, broker, Megatron) is what `rlstream experiment tool_use` runs (docs/demo.md)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlstream.common.config import EpisodeSettings, load_config
from rlstream.common.errors import ConfigError
from rlstream.common.tasks.arithmetic import Problem
from rlstream.common.tasks.arithmetic import CHARS
from rlstream.toy.tinymodel import EOS, SPECIALS

ROOT = Path(__file__).resolve().parents[4]
VOCAB = SPECIALS + CHARS
EOS_ID = VOCAB.index(EOS)


class CharTokenizer:
    """The tiny model's tokenizer, one id per character (no files needed)."""

    eos_token_id = EOS_ID
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        return [VOCAB.index(c) for c in text]  # the scripted texts hold no special token's text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and VOCAB[i] in SPECIALS))


class ScriptedModel:
    """A causal LM that writes `script(prompt)` after the prompt (then EOS), whatever
    the context says; its "KV cache" is the token sequence so far."""

    def __init__(self, script):
        self.script, self.tok = script, CharTokenizer()

    def __call__(self, input_ids, past_key_values=None, use_cache=True):
        import torch

        seqs = input_ids.tolist() if past_key_values is None else [
            p + x for p, x in zip(past_key_values, input_ids.tolist())]
        logits = torch.full((len(seqs), 1, len(VOCAB)), -1e9)
        for b, seq in enumerate(seqs):
            plen = seq.index(VOCAB.index("=")) + 1
            prompt = self.tok.decode(seq[:plen])
            target = seq[:plen] + self.tok.encode(self.script(prompt)) + [EOS_ID]
            ok = len(seq) < len(target) and target[:len(seq)] == seq
            logits[b, 0, target[len(seq)] if ok else VOCAB.index("?")] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=seqs)


def oracle(prompt: str) -> str:
    """The worked solution with the tool: what a perfect tool user writes (observations included)."""
    from rlstream.common.tasks.envs.calculator import reference_turns

    return "".join(text for text, _ in reference_turns(prompt))


PROBLEMS = [Problem("12+7=", "19"), Problem("37+48-19=", "66"), Problem("3-48=", "-45"),
            Problem("40-46+34=", "28")]
LIMITS = EpisodeSettings(max_turns=3, max_turn_tokens=12, max_episode_tokens=48)


def test_reference_turns_are_calls_observations_and_the_answer_the_environment_accepts():
    from rlstream.common.tasks.envs.calculator import CalculatorEnv, reference_turns
    from rlstream.common.tasks.environment import ModelTurn
    from rlstream.common.tasks.task import Task

    assert reference_turns("37+48-19=") == [("c(37+48)", True), ("=85,", False), ("c(85-19)", True),
                                            ("=66,", False), ("66", True)]
    assert reference_turns("3-48=") == [("c(3-48)", True), ("=-45,", False), ("-45", True)]
    assert reference_turns("what is 3+4?") is None and reference_turns("12=") is None
    for p in PROBLEMS:  # replayed through the environment: same observations, reward 1
        env = CalculatorEnv()
        env.reset(Task(p.prompt, p.answer, lambda t, a=p.answer: (float(t == a), {})))
        turns = reference_turns(p.prompt)
        for (text, is_model), nxt in zip(turns, turns[1:] + [None]):
            if is_model:
                r = env.step(ModelTurn(text, (), "stop"))
                assert r.observation == (nxt[0] if nxt else None)
        assert (r.done, r.reward, r.info["tool_calls"]) == (True, 1.0, len(turns) // 2)


def test_tool_sft_examples_learn_model_turns_and_eos_not_prompt_or_observations():
    from rlstream.harness.sft import ToolSft, _encode_examples

    tok = CharTokenizer()
    (ids, mask), = _encode_examples(tok, [Problem("3-48=", "-45")], ToolSft(LIMITS, traces=1.0))
    assert tok.decode(ids, skip_special_tokens=False) == "3-48=c(3-48)=-45,-45" + EOS
    learned = "".join(VOCAB[i] if m else "." for i, m in zip(ids, mask))
    assert learned == "....." + "c(3-48)" + "....." + "-45" + EOS
    (ids, mask), = _encode_examples(tok, [Problem("3-48=", "-45")], ToolSft(LIMITS, traces=0.0))
    assert "".join(VOCAB[i] if m else "." for i, m in zip(ids, mask)) == ".....-45" + EOS
    mixed = _encode_examples(tok, PROBLEMS * 50, ToolSft(LIMITS, traces=0.5))
    share = sum(VOCAB.index("c") in ids for ids, _ in mixed) / len(mixed)
    assert 0.35 < share < 0.65  # a seeded half are tool episodes
    with pytest.raises(ConfigError, match="worked solution"):
        _encode_examples(tok, [Problem("what?", "1")], ToolSft(LIMITS, traces=1.0))


def test_sft_marker_changes_only_for_the_tool_stage(tmp_path):
    from rlstream.harness.sft import SftConfig, ToolSft, _marker

    (tmp_path / "model.safetensors").write_bytes(b"w")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    plain = _marker(SftConfig(), tmp_path, data, data)
    assert "tool" not in plain  # warm starts built before this stage are still reused
    assert _marker(SftConfig(), tmp_path, data, data, ToolSft(LIMITS))["tool"]["traces"] == 0.5


def test_episodes_with_the_tool_drive_the_environment_and_score_the_final_answer():
    from rlstream.harness.tool_eval import run_episodes

    model = ScriptedModel(oracle)
    outs = run_episodes(model, model.tok, PROBLEMS, LIMITS)
    assert [o.reward for o in outs] == [1.0] * 4 and [o.end for o in outs] == ["done"] * 4
    assert [o.tool_calls for o in outs] == [1, 2, 1, 2]
    assert outs[1].transcript == "37+48-19=c(37+48)=85,c(85-19)=66,66"
    wrong = ScriptedModel(lambda p: "c(1+1)=2,5")  # a call, then a wrong answer
    assert [o.reward for o in run_episodes(wrong, wrong.tok, PROBLEMS[:1], LIMITS)] == [0.0]


def test_limits_end_episodes_as_in_the_producer():
    from rlstream.harness.tool_eval import run_episodes

    caller = ScriptedModel(lambda p: "c(1)=1," * 10)  # calls forever
    (o,) = run_episodes(caller, caller.tok, PROBLEMS[:1], LIMITS)
    assert (o.end, o.reward, o.tool_calls) == ("max_turns", 0.0, 3)
    (o,) = run_episodes(caller, caller.tok, PROBLEMS[:1], LIMITS.model_copy(update={"max_episode_tokens": 7}))
    assert (o.end, o.reward) == ("max_tokens", 0.0)  # "c(1)" + "=1," would leave no room for a turn
    (o,) = run_episodes(caller, caller.tok, PROBLEMS[:1], LIMITS.model_copy(update={"max_episode_tokens": 10}))
    assert (o.end, o.transcript) == ("done", "12+7=c(1)=1,c(1")  # cut for length: that is the answer
    rambler = ScriptedModel(lambda p: "1" * 30)  # never stops: the turn ends for length, it is the answer
    (o,) = run_episodes(rambler, rambler.tok, PROBLEMS[:1], LIMITS)
    assert (o.end, o.reward, o.transcript) == ("done", 0.0, "12+7=" + "1" * 12)


def test_a_special_tokens_text_in_prompts_and_observations_stays_text_as_in_the_producer():
    """On c99ceb0 the harness parsed "<eos>" in a prompt or a tool's observation as the EOS token
    itself (the producer keeps such text as characters): it scored other episodes than it runs."""
    import torch

    from rlstream.harness import tool_eval
    from rlstream.harness.evaluate import generate_text
    from rlstream.toy.tinymodel import build_tokenizer
    from rlstream.common.tasks.environment import StepResult
    from rlstream.producer.rollout.observation import ObservationEncoder

    tok = build_tokenizer()
    eos = tok.eos_token_id

    class HostileEnv:  # its prompt and its observation carry the special token's text
        stop_texts = ()

        def reset(self, task):
            return task.prompt

        def step(self, turn):
            return StepResult(observation="=<eos>,")

    ep = tool_eval._start(HostileEnv, tok, Problem("1+<eos>2=", "3"))
    assert eos not in ep.ids and len(ep.ids) == len("1+<eos>2=")
    n, call = len(ep.ids), tok.encode("c", add_special_tokens=False)
    tool_eval._take_turn(ep, call, tok, LIMITS, frozenset())
    assert ep.ids[n:n + 2] == call + [eos]  # the model's turn ends with its own EOS
    assert ep.ids[n + 2:] == ObservationEncoder(tok)("=<eos>,", eos) and eos not in ep.ids[n + 2:]

    seen = []

    def eos_model(input_ids, past_key_values=None, use_cache=True):  # records its input, answers EOS
        seen.append(input_ids.tolist())
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], len(tok))
        logits[..., eos] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=None)

    assert generate_text(eos_model, tok, ["1+<eos>2="], max_new_tokens=2) == [""]
    assert eos not in seen[0][0] and len(seen[0][0]) == len("1+<eos>2=")

    from rlstream.harness.sft import _encode_examples  # the warm start's examples, likewise

    (ids, mask), = _encode_examples(tok, [Problem("1+<eos>2=", "<eos>")])
    assert ids.count(eos) == 1 and ids[-1] == eos and len(ids) == len("1+<eos>2=<eos>") + 1


def test_heldout_scores_with_the_tool_and_without():
    from rlstream.harness.evaluate import heldout_scores

    model = ScriptedModel(oracle)
    s = heldout_scores(model, model.tok, PROBLEMS, "avg@2", 1.0, 8, episodes=LIMITS)
    assert (s["accuracy"], s["greedy"], s["pass"], s["call_rate"]) == (1.0, 1.0, 1.0, 1.0)
    assert s["calls_per_episode"] == 1.5 and s["ends"] == {"done": 4}
    assert s["no_tool"] == 0.0 and s["no_tool_avg"] == 0.0  # single-turn it writes a call: wrong
    direct = ScriptedModel(lambda p: str(eval(p[:-1])))  # noqa: S307 - answers without the tool
    s = heldout_scores(direct, direct.tok, PROBLEMS, "greedy", 1.0, 8, episodes=LIMITS)
    assert (s["accuracy"], s["no_tool"], s["call_rate"]) == (1.0, 1.0, 0.0)


def test_the_tool_use_experiment_needs_episodes_and_reports_both_sides(tmp_path):
    from rlstream.harness.experiments import arms
    from rlstream.harness.runs import Warm
    from rlstream.harness.tool_use import report

    with pytest.raises(ConfigError) as e:
        arms("tool_use", load_config(ROOT / "configs/tiny-cpu.yaml", environ={}))
    assert e.value.key == "producer.episodes"
    cfg = load_config(ROOT / "configs/tiny-calculator.yaml", environ={})
    assert cfg.producer.episodes.env == "calculator" and [a.name for a in arms("tool_use", cfg)] == ["rl"]
    warm = Warm(tmp_path, tmp_path / "t", tmp_path / "h", 0.3, 1.0, 10, False, "avg@8", 0.4)
    before = {"accuracy": 0.3, "greedy": 0.4, "no_tool": 0.22, "no_tool_avg": 0.13, "call_rate": 0.5,
              "examples": ["12+7=c(12+7)=19,19"]}
    md = report(warm, before, {**before, "accuracy": 0.6}, {"rl_gain_with_tool": 0.3})
    assert "| warm start (format SFT) | 0.300 | 0.400 | 0.130 | 0.220 | 0.500 | - |" in md
    assert "| after RL | 0.600 |" in md and "rl_gain_with_tool: 0.300" in md and "12+7=c(12+7)=19,19" in md


def test_tool_format_sft_on_the_real_tiny_model_saves_and_is_reused(tiny_model_dir, tmp_path):
    """Two steps of the tool stage on the random tiny model (HF, KV cache): it trains, is
    evaluated with the tool, saves a loadable model with its marker, and is reused."""
    from rlstream.harness.evaluate import heldout_scores
    from rlstream.harness.hf_decode import load_model
    from rlstream.harness.sft import SftConfig, ToolSft, warm_start
    from rlstream.common.tasks.arithmetic import write_problems

    data = write_problems(tmp_path / "p.jsonl", PROBLEMS)
    cfg = SftConfig(band_low=0.9, band_high=1.0, max_steps=2, eval_every=2, batch_size=4, num_threads=1)
    tool = ToolSft(LIMITS, traces=0.5)
    res = warm_start(tiny_model_dir, tmp_path / "tool", data, data, cfg, tool=tool)
    assert (res.steps, res.reused, len(res.history)) == (2, False, 1) and 0.0 <= res.accuracy <= 1.0
    assert warm_start(tiny_model_dir, tmp_path / "tool", data, data, cfg, tool=tool).reused
    assert not warm_start(tiny_model_dir, tmp_path / "tool2", data, data, cfg, tool=ToolSft(LIMITS, 1.0)).reused
    model, tok = load_model(tmp_path / "tool")
    s = heldout_scores(model, tok, PROBLEMS, "greedy", 1.0, 8, episodes=LIMITS)
    assert sum(s["ends"].values()) == 4 and set(s["ends"]) <= {"done", "max_turns", "max_tokens"}
