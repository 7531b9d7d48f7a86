"""The trainer's memory measures change memory only (consumer.memory): chunked
log-probs equal full-vocabulary ones (values, entropy, gradients), SDPA equals
Megatron's local attention, activation recompute keeps Routing Replay through
backward, and micro-batched or recomputed steps equal the plain step."""
from __future__ import annotations

import pytest
import torch

from rlstream.common.config import ConsumerSettings
from rlstream.consumer.train import replay
from rlstream.consumer.train.logprobs import logprobs_from_logits
from rlstream.consumer.train.model import forward_logits, load_hf_checkpoint, per_token_logprobs
from rlstream.consumer.train.trainer import Trainer

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def models(megatron_world, sharp_model_dir):
    """The same weights with local attention, SDPA, and SDPA + full recompute."""
    return {"local": load_hf_checkpoint(sharp_model_dir, attention="local"),
            "sdpa": load_hf_checkpoint(sharp_model_dir, attention="sdpa"),
            "recompute": load_hf_checkpoint(sharp_model_dir, attention="sdpa", recompute=True)}


@pytest.fixture(scope="module")
def tokens(models):
    vocab = models["sdpa"].hf_dims.vocab_size
    return torch.randint(3, vocab, (4, 41), generator=torch.Generator().manual_seed(3))


def run(model, fn):
    """(log-probs, gradients) of fn()'s weighted sum."""
    model.zero_grad(set_to_none=True)
    lp = fn()
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)  # every position matters
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_diff(a: dict, b: dict, origin: dict | None = None) -> float:
    """||a - b|| / ||b - origin|| over every tensor (Frobenius; origin 0 by default).
    The sharp model's weights and gradients reach ~80, so absolute differences of
    float32 summation order are ~1e-4 where relative ones are ~1e-6."""
    def norm(x: dict, y: dict | None) -> float:
        return sum(float((x[k] - (y[k] if y else 0)).double().pow(2).sum()) for k in x) ** 0.5
    return norm(a, b) / norm(b, origin)


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_logprobs_equal_full_logits(models, tokens, chunk):
    m = models["sdpa"]
    full_lp, full_grads = run(m, lambda: logprobs_from_logits(forward_logits(m, tokens[:, :-1]),
                                                              tokens[:, 1:]))
    lp, grads = run(m, lambda: per_token_logprobs(m, tokens, chunk_tokens=chunk))
    assert lp.shape == (4, 40)
    assert float((lp - full_lp).abs().max()) < 1e-5          # measured ~1e-6
    assert rel_diff(grads, full_grads) < 1e-6                 # measured ~1e-8
    with torch.no_grad():
        _, ent = per_token_logprobs(m, tokens, with_entropy=True, chunk_tokens=chunk)
        _, full_ent = logprobs_from_logits(forward_logits(m, tokens[:, :-1]), tokens[:, 1:], True)
    assert float((ent - full_ent).abs().max()) < 1e-5


def test_temperature_divides_each_samples_logits(models, tokens):
    m, t = models["sdpa"], torch.tensor([1.0, 0.5, 2.0, 0.7])
    with torch.no_grad():
        lp, ent = per_token_logprobs(m, tokens, with_entropy=True, temperature=t, chunk_tokens=16)
        logits = forward_logits(m, tokens[:, :-1]) / t[:, None, None]
        want_lp, want_ent = logprobs_from_logits(logits, tokens[:, 1:], with_entropy=True)
    assert float((lp - want_lp).abs().max()) < 1e-5 and float((ent - want_ent).abs().max()) < 1e-5


def test_sdpa_equals_local_attention(models, tokens):
    lp_l, g_l = run(models["local"], lambda: per_token_logprobs(models["local"], tokens))
    lp_s, g_s = run(models["sdpa"], lambda: per_token_logprobs(models["sdpa"], tokens))
    assert float((lp_s - lp_l).abs().max()) < 1e-5  # measured 4.8e-7
    assert rel_diff(g_s, g_l) < 1e-5                 # measured ~2e-6


def random_routing(model, tokens, seed=1):
    d = model.hf_dims
    b, s = tokens.shape[0], tokens.shape[1] - 1
    scores = torch.rand(b, s, d.num_layers, d.num_experts, generator=torch.Generator().manual_seed(seed))
    return torch.argsort(scores, -1)[..., :d.topk].to(torch.uint8)


def replay_grads(model, tokens, routing, through_backward: bool):
    """Gradients under a replayed routing; `through_backward=False` is the trainer
    before recompute existed: the replay ended before backward."""
    def fn():
        with replay.replaying(model, routing) as backward:
            lp = per_token_logprobs(model, tokens)
            if through_backward:
                backward((lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum())
        return lp
    model.zero_grad(set_to_none=True)
    lp = fn()
    if not through_backward:
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_keeps_the_replayed_routing_in_backward(models, tokens):
    routing = random_routing(models["sdpa"], tokens)
    ref = replay_grads(models["sdpa"], tokens, routing, through_backward=True)
    got = replay_grads(models["recompute"], tokens, routing, through_backward=True)
    assert rel_diff(got, ref) < 1e-6  # measured 0 (bit-identical)
    # negative control: replay cleared before backward, the recomputed forward
    # re-routes with the routers' own top-k and the gradients are silently wrong
    stale = replay_grads(models["recompute"], tokens, routing, through_backward=False)
    assert rel_diff(stale, ref) > 1e-3


def sgd_step(model_dir, rollouts, replay_mode: str, **memory):
    cfg = ConsumerSettings(replay=replay_mode, num_minibatches=2, memory=memory,
                           optimizer={"name": "sgd", "lr": 0.05, "grad_clip": 0})
    trainer = Trainer.from_hf(model_dir, cfg)
    gb = trainer.build_batch(rollouts, 4)
    metrics = trainer.train_step(gb)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return weights, metrics, [len(mb.micro_batches()) for mb in gb.minibatches]


@pytest.mark.parametrize("replay_mode", ["R2", "R3"])
def test_recomputed_and_micro_batched_steps_equal_the_plain_step(sharp_model_dir, bf16_rollouts,
                                                                  replay_mode):
    base, base_m, parts = sgd_step(sharp_model_dir, bf16_rollouts, replay_mode, attention="sdpa")
    assert parts == [1, 1]
    start = {n: p.detach() for n, p in load_hf_checkpoint(sharp_model_dir).named_parameters()}
    assert max(float((base[k] - start[k]).abs().max()) for k in base) > 1e-3  # the step moves weights
    for memory in ({"recompute": True}, {"micro_batch_tokens": 40},
                   {"recompute": True, "micro_batch_tokens": 40, "logprob_chunk_tokens": 16}):
        got, m, parts = sgd_step(sharp_model_dir, bf16_rollouts, replay_mode, attention="sdpa", **memory)
        if "micro_batch_tokens" in memory:
            assert min(parts) > 3, parts  # several micro-batches per mini-batch
        # SGD: the weight change is lr * gradient; measured 0 (recompute), ~1.5e-6
        # (micro-batches: float32 summation order), relative to the change itself
        assert rel_diff(got, base, start) < 1e-5, memory
        for key in ("loss", "grad_norm", "entropy", "routing_agreement_layer_0"):
            assert m[key] == pytest.approx(base_m[key], rel=1e-4), (memory, key)
        # the KL estimate (~1e-3) is a mean of differences of log-probs near 1 in size: the float32
        # summation order of micro-batches moves it by ~1e-7 absolute (CI: 1.3e-7, 1.4e-4 relative)
        assert m["kl_train_inference"] == pytest.approx(base_m["kl_train_inference"], rel=1e-4, abs=5e-7), memory
