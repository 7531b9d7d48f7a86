"""Multi-turn episodes end to end on the real vLLM engine and the real Megatron trainer.

The session's vLLM CPU engine (fp32, routing capture) runs 8 episodes at once
through `producer.rollout.episodes.EpisodeRunner`. `Turns` is an environment that
answers every model turn with an observation ("=<turn>,") and ends the episode
after 3 model turns: the random tiny model does not know the calculator's call
format, so with the calculator every episode would end after one turn (that is
checked too). A weight update (the same weights as version 1) lands while
episodes are between or inside turns. The records go through the wire format
(schema 2) and are checked: mask (environment tokens are exactly the
observations' tokens, where they were appended), log-probs (0 on environment
tokens, vLLM's on model tokens), versions (run-length, oldest = 0, the update
visible), routing for every input position. Then the trainer's fp32 forward,
replaying the records' routing (R3), gives vLLM's log-probs on model tokens of
every turn within the single-turn tolerance (test_temperature_parity.py).
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MATCH_TOL = 1e-4  # test_temperature_parity.py / test_routing_capture.py
G = 4
TURNS = 3


class Turns:
    """Every model turn gets an observation; done after TURNS turns, reward = turns."""

    stop_texts = ()

    def reset(self, task):
        self.n = 0
        return task.prompt

    def step(self, turn):
        from rlstream.common.tasks.environment import StepResult

        self.n += 1
        if self.n >= TURNS:
            return StepResult(None, float(self.n), True, {"last": turn.text[:16]})
        return StepResult(f"={self.n},")


def run_episodes(engine, env, reload_dir=None, prompts=("12+7=", "40+45=")):
    """One group of G episodes per prompt, the second group started when the first's first
    turns finished (so turns of different episodes share engine steps); optionally a weight
    update at that moment too. Returns (ended episodes, runner, whether turns mixed)."""
    from rlstream.common.config import EpisodeSettings
    from rlstream.producer.rollout.episodes import EpisodeRunner
    from rlstream.common.tasks.task import Task
    from rlstream.producer.sample import SamplingConfig

    settings = EpisodeSettings(max_turns=TURNS, max_turn_tokens=6, max_episode_tokens=48, step_timeout_s=30)
    runner = EpisodeRunner(engine, settings, SamplingConfig(max_tokens=6), env)
    def start(i):
        for j in range(G):
            runner.start(f"ep-{i}", j, G, Task(prompts[i], "0", lambda t: (0.0, {})))

    start(0)
    ended, mixed, later = [], False, list(range(1, len(prompts)))
    for _ in range(2000):
        finished = engine.step() if engine.has_work() else []
        if finished and later:
            start(later.pop(0))
            if reload_dir is not None and not later:
                engine.reload_weights(reload_dir, engine.version + 1)
        ended += runner.advance(finished, wait_s=0.0 if finished else 0.01)
        mixed |= len({tag.rsplit("#t", 1)[1] for tag in runner._turns}) > 1
        if not runner.has_work():
            break
    runner.close()
    return ended, runner, mixed


@pytest.mark.timeout(900)
def test_episodes_on_the_real_engine_record_turns_masks_logprobs_versions_and_routing(rollout_engine,
                                                                                      tiny_model_dir):
    from rlstream.common.record import decode, encode

    ended, runner, mixed = run_episodes(rollout_engine, Turns, reload_dir=tiny_model_dir)
    assert len(ended) == 2 * G and mixed  # all published; episodes at different turns shared steps
    saw_update = False
    for ep in ended:
        assert ep.end in ("done", "max_tokens"), ep.info
        r = decode(encode(ep.to_rollout("it", runner.sampling, None)))
        assert r.loss_mask is not None and r.loss_mask[0] and r.loss_mask[-1]
        # environment tokens are exactly the observations, appended once each, between model turns
        env_runs = np.split(r.response_ids[~r.loss_mask], np.flatnonzero(np.diff(np.flatnonzero(~r.loss_mask)) > 1) + 1)
        texts = [rollout_engine.decode(run) for run in env_runs]
        assert texts == [f"={k + 1}," for k in range(len(texts))] and len(texts) == ep.turns - 1
        assert (r.logprobs[~r.loss_mask] == 0).all() and (r.logprobs[r.loss_mask] <= 0).all()
        assert (r.logprobs[r.loss_mask] < 0).any()
        # group ep-0 began at version 0 and lived through the update; ep-1 was dispatched just
        # before it, so its first token was sampled at version 1 (the record's policy_version)
        assert r.oldest_version == r.policy_version == (0 if r.group_id == "ep-0" else 1)
        if r.token_versions is not None:
            assert r.group_id == "ep-0"
            saw_update |= r.token_versions[:, 0].tolist() == [0, 1]
        assert r.routed_experts.shape[0] == r.prompt_ids.size + r.num_tokens - 1
        assert ep.turns == TURNS or ep.end == "max_tokens"
    assert saw_update  # the update between or inside turns is in the per-token versions


@pytest.mark.timeout(600)
def test_the_calculator_environment_runs_on_the_real_engine(rollout_engine):
    from rlstream.common.record import decode, encode
    from rlstream.common.tasks.envs.calculator import CalculatorEnv

    ended, runner, _ = run_episodes(rollout_engine, CalculatorEnv)
    assert len(ended) == 2 * G
    for ep in ended:
        assert ep.end in ("done", "max_turns", "max_tokens")
        r = decode(encode(ep.to_rollout("it", runner.sampling, None)))
        assert r.reward_info["end"] == ep.end
        assert ep.end != "done" or "tool_calls" in r.reward_info  # the calculator's own info


@pytest.fixture
def trainer(megatron_world, tiny_model_dir):
    """A fresh fp32 trainer on the engine's weights, replaying rollout routing (R3)."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    return Trainer.from_hf(tiny_model_dir, ConsumerSettings(group_size=G, groups_per_batch=2, replay="R3"))


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_trainer_log_probs_match_vllm_on_model_tokens_of_every_turn(rollout_engine, trainer):
    import torch

    from rlstream.common.record import decode, encode
    from rlstream.consumer.train.batch import TrainSample
    from rlstream.consumer.train.model import per_token_logprobs
    from rlstream.consumer.train.replay import replaying

    ended, runner, _ = run_episodes(rollout_engine, Turns)
    records = [decode(encode(ep.to_rollout("parity", runner.sampling, None))) for ep in ended]
    assert sum(ep.turns for ep in ended) > 2 * G  # later turns are in the comparison
    gb = trainer.build_batch([TrainSample.from_rollout(r) for r in records], group_size=G)
    mb = gb.minibatches[0]
    with torch.no_grad(), replaying(trainer.model, mb.routing):
        pi_old = per_token_logprobs(trainer.model, mb.tokens, temperature=mb.temperature)
    mask, mu = mb.loss_mask, mb.rollout_logprobs
    assert int(mask.sum()) == sum(r.num_model_tokens for r in records)
    diff = ((pi_old - mu).abs() * mask).amax(-1)
    late = torch.zeros_like(mask)  # model tokens after the first environment turn
    for i, r in enumerate(records):
        first_env = int(np.flatnonzero(~r.loss_mask)[0]) if (~r.loss_mask).any() else r.num_tokens
        p = r.prompt_ids.size
        late[i, p - 1 + first_env:p - 1 + r.num_tokens] = mask[i, p - 1 + first_env:p - 1 + r.num_tokens]
    print(f"\nmulti-turn: max |pi_old - mu_old| = {float(diff.max()):.3g} over {int(mask.sum())} model tokens "
          f"({int(late.sum())} after an environment turn)")
    assert int(late.sum()) > 0
    assert float(diff.max()) < MATCH_TOL


@pytest.mark.timeout(600)
def test_the_real_engines_tokenizer_keeps_a_special_tokens_text_as_text(rollout_engine):
    """vLLM's tokenizer wrapper passes split_special_tokens through (producer/text_tokens.py)."""
    from rlstream.producer.rollout.observation import ObservationEncoder

    eos = rollout_engine.tokenizer().eos_token_id
    assert eos in rollout_engine.tokenizer().encode("1+<eos>2=", add_special_tokens=False)  # parsed by default
    assert eos not in rollout_engine.encode("1+<eos>2=")
    assert eos not in ObservationEncoder(rollout_engine.tokenizer())("=<eos>,")
    assert rollout_engine.encode("12+7=").tolist() == rollout_engine.tokenizer().encode("12+7=",
                                                                                        add_special_tokens=False)
