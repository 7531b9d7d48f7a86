"""The trainer takes its log-probs at the record's sampling temperature (issue #13).

vLLM's log-probs (`logprobs_mode: processed_logprobs`) are those of the
distribution it sampled from, softmax(logits / T). The real vLLM engine (the
session's, fp32, CPU routing capture) samples groups at T = 0.7 and 1.3; the
records go through the wire format (which carries `temperature`) into the
trainer's fp32 Megatron model, which replays the captured routing (R3) so
both sides run the same experts. Then, per response token:

- pi_old from `per_token_logprobs` at the batch's temperatures equals vLLM's
  mu_old within the tolerance of the routing-capture proof
  (test_routing_capture.py, MATCH_TOL = 1e-4);
- at temperature 1 (what the trainer computed before the fix) it does not:
  every sample misses by more than 10 x that tolerance;
- the trainer's own step (`Trainer.train_step`, one update, so pi = pi_old)
  sees IS weights pi/mu_old of 1 on every token and no training-inference KL.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

MATCH_TOL = 1e-4  # test_routing_capture.py: vLLM fp32 vs an independent fp32 forward
G = 4


def sample_records(engine, temperature: float) -> list:
    """3 groups of G from vLLM at `temperature`, as decoded wire records."""
    from rlstream.common.record import decode, encode
    from rlstream.producer.rollout.trajectory import Trajectory
    from rlstream.producer.sample import SamplingConfig

    sampling = SamplingConfig(max_tokens=16, temperature=temperature)
    for i, text in enumerate(["12+7=", "3-1=", "40+45="]):
        engine.submit_group(engine.encode(text), G, sampling, tag=f"t{temperature}-{i}")
    finished = []
    for _ in range(500):
        finished += engine.step()
        if not engine.num_in_flight:
            break
    assert len(finished) == 3 * G and all(s.routed_experts is not None for s in finished)
    records = []
    for s in finished:
        t = Trajectory.of_sample(s)
        t.reward = float(s.sample_idx % 2)
        records.append(decode(encode(t.to_rollout("parity", sampling))))
    return records


@pytest.fixture
def trainer(megatron_world, tiny_model_dir):
    """A fresh fp32 trainer on the engine's weights (its step changes them), replaying rollout routing."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    return Trainer.from_hf(tiny_model_dir, ConsumerSettings(group_size=G, groups_per_batch=3, replay="R3"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_trainer_pi_old_matches_vllm_mu_old_at_the_records_temperature(rollout_engine, trainer, temperature):
    import torch

    from rlstream.consumer.train.batch import TrainSample
    from rlstream.consumer.train.model import per_token_logprobs
    from rlstream.consumer.train.replay import replaying

    records = sample_records(rollout_engine, temperature)
    assert all(r.temperature == pytest.approx(temperature) for r in records)
    gb = trainer.build_batch([TrainSample.from_rollout(r) for r in records], group_size=G)
    mb = gb.minibatches[0]
    assert mb.temperature.tolist() == pytest.approx([temperature] * len(records))
    with torch.no_grad(), replaying(trainer.model, mb.routing):
        at_t = per_token_logprobs(trainer.model, mb.tokens, temperature=mb.temperature)
    with torch.no_grad(), replaying(trainer.model, mb.routing):
        at_one = per_token_logprobs(trainer.model, mb.tokens)  # the trainer before the fix
    mask, mu = mb.loss_mask, mb.rollout_logprobs
    diff = ((at_t - mu).abs() * mask).amax(-1)
    wrong = ((at_one - mu).abs() * mask).amax(-1)
    print(f"\nT={temperature}: max |pi_old - mu_old| = {float(diff.max()):.3g} over {int(mask.sum())} tokens; "
          f"at T=1 instead: min over samples of the max = {float(wrong.min()):.3g}")
    assert float(diff.max()) < MATCH_TOL
    assert float(wrong.min()) > 10 * MATCH_TOL
    m = trainer.train_step(gb)  # the trainer's own path (R3, N = 1: pi = pi_old at the update)
    assert math.log(m["is_weight_max"]) < MATCH_TOL and abs(m["kl_train_inference"]) < MATCH_TOL, m
    assert np.isfinite(m["loss"])
