"""producer/rollout/episodes.py and common/tasks/envs/calculator.py: the episode protocol's logic
(limits, failures, versions, routing, the record) over a scripted stand-in engine
(tests/support/scripted.py);
tests/integration/test_episodes.py runs the same with the real vLLM engine."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rlstream.common.errors import ConfigError
from rlstream.common.record import decode, encode
from rlstream.toy.tinymodel import build_tokenizer
from rlstream.common.tasks.envs.calculator import CalculatorEnv, calculate
from rlstream.common.tasks.environment import ModelTurn, StepResult
from rlstream.producer.rollout.episodes import EpisodeRunner
from rlstream.producer.rollout.observation import ObservationEncoder
from rlstream.producer.sample import SamplingConfig
from tests.support.scripted import TOK, AbortingEngine, K, L, ScriptedEngine, run, settings, task


def test_calculator_tool():
    assert [calculate(e) for e in ("37+48", "85-19", "2*3+4", "-5+2", "7/2", "7/0", "1+", "a")] ==\
        ["85", "66", "10", "-3", "3", "err", "err", "err"]
    env = CalculatorEnv()
    assert env.reset(task()) == "37+48-19="
    assert env.step(ModelTurn("c(37+48)", (), "stop")).observation == "=85,"
    assert env.step(ModelTurn("c(37+)", (), "stop")).observation == "=err,"
    final = env.step(ModelTurn("66", (), "stop"))
    assert final.done and final.reward == 1.0 and final.info["tool_calls"] == 2


def test_episodes_interleave_and_record_turns_masks_versions_and_routing():
    script = {0: ["c(37+48)", "c(85-19)", "66$"], 1: ["66$"], 2: ["c(1+1)", "7$"]}
    eng = ScriptedEngine(script)
    runner = EpisodeRunner(eng, settings(), SamplingConfig(max_tokens=16), CalculatorEnv)
    assert runner.sampling.stop_token_ids == (int(TOK.encode(")", add_special_tokens=False)[0]),)
    for i in range(3):
        runner.start("g", i, 3, task())
    ended = []
    ended += runner.advance([], wait_s=0.5)  # resets answered: three first turns in the engine at once
    assert len(eng.requests) == 3
    ended += runner.advance(eng.step(), wait_s=0.5)
    for _ in range(50):  # until episodes 0 and 2 have their second turn in the engine
        if len(eng.requests) == 2:
            break
        ended += runner.advance([], wait_s=0.1)
    eng.version = 1  # a weight update while turn 2 generates: its second half is sampled at 1
    ended += run(eng, runner)
    by = {e.sample_idx: e for e in ended}
    assert sorted(by) == [0, 1, 2] and by[0].turns == 3 and by[1].turns == 1 and by[2].turns == 2
    assert (by[0].reward, by[1].reward, by[2].reward) == (1.0, 1.0, 0.0)
    r = decode(encode(by[0].to_rollout("p", runner.sampling, "37+48-19=")))
    text = "c(37+48)=85,c(85-19)=66,66"
    assert TOK.decode(r.response_ids.tolist(), skip_special_tokens=True) == text
    env = [c in "=85,66" and i in (8, 9, 10, 11, 20, 21, 22, 23) for i, c in enumerate(text)] + [False]
    assert r.loss_mask.tolist() == [not e for e in env]
    assert (r.logprobs[~r.loss_mask] == 0).all() and (r.logprobs[r.loss_mask] == -0.25).all()
    assert r.oldest_version == 0 and r.policy_version == 0
    # turn 1 (8) + env 1 (4) + first half of turn 2 (4) at 0; the rest (env 2 appended at 1) at 1
    assert r.token_versions.tolist() == [[0, 16], [1, len(text) + 1 - 16]]
    # row i of the routing comes from the first turn that computed it: turn 1 rows 0..P+6 (its last
    # token is never an input of turn 1), turn 2 from there through its own tokens, turn 3 the rest
    P = len("37+48-19=")
    rows = P + r.num_tokens - 1
    assert r.routed_experts.shape == (rows, L, K)
    assert r.routed_experts[:, 0, 0].tolist() == [0] * (P + 7) + [1] * 12 + [2] * (rows - P - 19)
    assert (r.routed_experts[:, 0, 1] == 3 + np.arange(rows) % 5).all()
    single = by[1].to_rollout("p", runner.sampling, None)
    assert single.loss_mask is None  # no environment token: written as schema 1


def test_limits_and_failures_end_episodes_with_a_reason():
    calls = {0: ["c(1+1)"] * 9}
    eng = ScriptedEngine(calls)
    runner = EpisodeRunner(eng, settings(max_turns=3), SamplingConfig(), CalculatorEnv)
    runner.start("g", 0, 1, task())
    (ep,) = run(eng, runner)
    assert (ep.end, ep.turns, ep.reward) == ("max_turns", 3, 0.0)
    to = ep.to_rollout("p", runner.sampling, None)
    assert to.finish_reason == "length" and to.reward_info["end"] == "max_turns"
    assert decode(encode(to)).loss_mask[-1]  # the response ends with a model turn

    eng = ScriptedEngine(calls)
    runner = EpisodeRunner(eng, settings(max_episode_tokens=20), SamplingConfig(), CalculatorEnv)
    runner.start("g", 0, 1, task())
    (ep,) = run(eng, runner)
    assert ep.end == "max_tokens" and ep.response_ids.size <= 20


class Broken(CalculatorEnv):
    def step(self, turn):
        raise OSError("tool server down")


class Hangs(CalculatorEnv):
    gate = threading.Event()

    def step(self, turn):
        self.gate.wait(10)
        return StepResult("=1,")


class Garbage(CalculatorEnv):
    def reset(self, task):
        return 42


@pytest.mark.timeout(30)
def test_env_errors_and_timeouts_end_the_episode_never_hang():
    from rlstream.producer import telemetry
    from rlstream.common import metrics

    before = {e: metrics.value("rlstream_producer_episodes_total", end=e) or 0 for e in ("env_error", "step_timeout")}
    for env, end in ((Broken, "env_error"), (Hangs, "step_timeout")):
        eng = ScriptedEngine({0: ["c(1+1)"]})
        runner = EpisodeRunner(eng, settings(step_timeout_s=0.3), SamplingConfig(), env)
        runner.start("g", 0, 1, task())
        t0 = time.monotonic()
        (ep,) = run(eng, runner)
        assert ep.end == end and time.monotonic() - t0 < 5 and not runner.has_work()
        r = ep.to_rollout("p", runner.sampling, None)
        assert r.finish_reason == "abort" and r.reward_info["end"] == end and r.reward_info["error"]
        runner.close()
    Hangs.gate.set()
    eng = ScriptedEngine({0: ["1$"]})
    runner = EpisodeRunner(eng, settings(), SamplingConfig(), Garbage)
    runner.start("g", 0, 1, task())
    assert run(eng, runner) == [] and not runner.has_work()  # no turn: nothing to publish
    assert runner.take_unrecorded() == ["g"] and runner.take_unrecorded() == []  # its slot is released
    after = {e: metrics.value("rlstream_producer_episodes_total", end=e) for e in before}
    assert after["env_error"] == before["env_error"] + 2 and after["step_timeout"] == before["step_timeout"] + 1
    assert telemetry.EPISODES is not None


def test_a_stop_text_of_several_tokens_is_a_config_error():
    class Wordy(CalculatorEnv):
        stop_texts = ("</call>",)

    with pytest.raises(ConfigError) as e:
        EpisodeRunner(ScriptedEngine({}), settings(), SamplingConfig(), Wordy)
    assert e.value.key == "producer.episodes.env"


def test_observations_go_through_the_chat_template_once_without_the_models_closing_token():
    plain = ObservationEncoder(TOK)
    assert TOK.decode(plain("=85,")) == "=85,"
    tok = build_tokenizer()
    # a template within the tiny vocabulary: an assistant turn closes with <eos> and ':', a tool turn is
    # '=' content ',', the generation prompt is 'a:'
    tok.chat_template = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}"
                         "{{ eos_token }}:{%- elif m['role'] == 'tool' -%}={{ m['content'] }},"
                         "{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
                         "{%- if add_generation_prompt -%}a:{%- endif -%}")
    enc = ObservationEncoder(tok)
    eos = tok.eos_token_id
    assert tok.decode(enc("85", last_model_token=eos), skip_special_tokens=False) == ":=85,a:"
    assert tok.decode(enc("85", last_model_token=5), skip_special_tokens=False) == "<eos>:=85,a:"


def test_episode_settings_are_validated_and_off_by_default():
    from rlstream.common.config import ProducerSettings

    assert ProducerSettings().episodes is None
    assert ProducerSettings(episodes={"max_turns": 2}).episodes.max_turns == 2
    for bad in ({"env": "shell"}, {"max_turns": 0}, {"step_timeout_s": 0}, {"typo": 1}):
        with pytest.raises(Exception):
            ProducerSettings(episodes=bad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300, "1", None, [1.0]])
def test_a_step_reward_no_record_can_carry_ends_the_episode_with_env_error(bad):
    class BadReward(CalculatorEnv):
        def step(self, turn):
            return StepResult("=2,", reward=bad)

    eng = ScriptedEngine({0: ["c(1+1)", "2$"]})
    runner = EpisodeRunner(eng, settings(), SamplingConfig(), BadReward)
    runner.start("g", 0, 1, task())
    (ep,) = run(eng, runner)
    assert ep.end == "env_error" and "step reward" in ep.info["error"]
    r = ep.to_rollout("p", runner.sampling, None)
    assert decode(encode(r)).reward == 0.0  # published (its group completes) with the reward so far
    runner.close()


@pytest.mark.timeout(30)
def test_numpy_step_rewards_are_numbers():
    class NumpyReward(CalculatorEnv):
        def step(self, turn):
            return StepResult(None, reward=np.float32(0.5), done=True)

    eng = ScriptedEngine({0: ["2$"]})
    runner = EpisodeRunner(eng, settings(), SamplingConfig(), NumpyReward)
    runner.start("g", 0, 1, task())
    (ep,) = run(eng, runner)
    assert ep.end == "done" and ep.to_rollout("p", runner.sampling, None).reward == 0.5
    runner.close()


def test_a_group_beyond_the_staleness_bound_is_evicted_unpublished_and_its_slot_freed():
    """Stale eviction (producer/eviction.py) for episodes: the trainer moved past the bound of a
    group whose episodes are mid-episode; they end unpublished, their requests aborted."""
    from rlstream.common import metrics
    from rlstream.producer.groups import InFlightGroups
    from rlstream.producer.rollout.episodes import Episodes

    class Engine(AbortingEngine):
        def oldest_versions(self):
            return {tag: dispatch for tag, (_, _, dispatch) in self.requests.items()}

    eng = Engine({0: ["c(37+48)", "c(85-19)", "66$"], 1: ["c(1+1)", "c(2+2)", "7$"]})
    runner = EpisodeRunner(eng, settings(), SamplingConfig(max_tokens=16), CalculatorEnv)
    groups = InFlightGroups("p")
    driver = Episodes(runner, groups, "p")
    old, new = groups.open(task(), 2), groups.open(task(), 2)
    driver.start(old, task(), 2)
    for _ in range(200):  # the old group's first turns sampled at version 0, both second turns submitted
        if sorted(eng.requests) == [f"{old}#0#t1", f"{old}#1#t1"]:
            break
        first = [t for t in eng.requests if t.endswith("#t0")]
        driver.on_finished(eng.step() if len(first) == 2 else [])
    assert sorted(eng.requests) == [f"{old}#0#t1", f"{old}#1#t1"], eng.requests
    eng.version = 3
    driver.start(new, task(), 2)  # its turns start at version 3
    driver.on_finished([])
    evicted0 = metrics.value("rlstream_producer_evicted_groups_total") or 0
    driver.evict_stale(trainer_version=3, max_staleness=4)
    assert len(groups) == 2  # within the bound: nothing happens
    driver.evict_stale(trainer_version=5, max_staleness=4)  # 5 - 0 > 4: the old group is dropped
    assert (metrics.value("rlstream_producer_evicted_groups_total") or 0) - evicted0 == 1
    assert len(groups) == 1 and groups.get(old) is None and runner.active == 2
    assert not any(t.startswith(old) for t in eng.requests)  # its requests aborted in the engine
    records = []
    for _ in range(100):
        records += driver.on_finished(eng.step() if eng.has_work() else [])
        if not driver.has_work():
            break
    assert {r.group_id for r in records} == {new} and len(records) == 2
