"""The producer's engine on one GPU (issue #16; docs/producer-engine.md, "GPU path").

One engine for the module, as a GPU deployment runs it: upstream vLLM with
`routing: native` (vLLM's `enable_return_routed_experts`, Triton kernels),
prefix caching on (vLLM 0.31+ needs it for native routing) and CUDA graphs on
(`enforce_eager: false`), fp32 so that its outputs can be checked against HF
transformers on the host. The tests check:
  - every sample carries the routing of every input token, [P+T-1, layers,
    top_k] in `rlstream.common.record.routing_dtype_for(num_experts)`, valid and
    distinct expert ids, the same prompt rows for every sample of a group and
    for a later group whose prompt is served from the prefix cache, and it
    encodes into a valid record;
  - an in-place weight update through the producer's own path
    (`producer.weights.reload.Reloader.apply` of a `WeightsReady` for a version in the
    weight store): greedy outputs become those of the new weights (each token
    HF's argmax, log-probs HF's within 1e-3) and a reload of the base weights
    gives the base outputs back.
The CPU counterparts: test_engine.py, test_routing_capture.py,
test_producer_service.py. Skipped without CUDA (tests/gpu/conftest.py) or
without upstream vLLM (`needs_vllm`); nothing touches CUDA at import.
"""
from __future__ import annotations

import numpy as np
import pytest

from rlstream.producer.rollout.trajectory import Trajectory
from tests.support.engine import run_until_done

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENS = 24
PROMPT = "1234567890+9876543210=" * 2
"""Longer than two KV-cache blocks, so a second group's prompt is served from the prefix cache."""


@pytest.fixture(scope="module")
def gpu_engine(tiny_model_dir):
    """RolloutEngine on the tiny model: native routing, prefix caching, CUDA graphs."""
    import gc
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: the producer's GPU tests need upstream vLLM 0.32.0 "
                    "(`pip install .[gpu]`)")
    import torch

    from rlstream.common.config import EngineSettings
    from rlstream.producer.engine import RolloutEngine

    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests in this process cached is not free for vLLM
    settings = EngineSettings(dtype="float32", max_model_len=256, kv_cache_memory_bytes=None,
                              gpu_memory_utilization=0.3, routing="native", enable_prefix_caching=True,
                              enforce_eager=False, seed=0)
    engine = RolloutEngine(settings, tiny_model_dir, version=0)
    assert engine.routing_mode == "native" and engine._capture is None
    yield engine
    engine.close()


@pytest.mark.timeout(900)
def test_native_routing_with_prefix_caching_and_cuda_graphs(gpu_engine, tiny_model_dir):
    from rlstream.common.record import decode, encode, routing_dtype_for
    from rlstream.producer.sample import SamplingConfig
    from tests.fixtures.trainer import hf_config

    eng, cfg = gpu_engine, hf_config(tiny_model_dir)
    L, K, E = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["num_experts"]
    assert eng.num_experts == E
    sampling = SamplingConfig(max_tokens=16)
    prompt = eng.encode(PROMPT)
    assert prompt.size > 32  # two full KV blocks of 16: what the prefix cache keeps
    eng.submit_group(prompt, 4, sampling, tag="first")
    first = run_until_done(eng)
    eng.submit_group(prompt, 2, sampling, tag="cached")  # its prompt's KV blocks are in the prefix cache
    cached = run_until_done(eng)
    assert len(first) == 4 and len(cached) == 2
    P = prompt.size
    for s in first + cached:
        T = s.response_ids.size
        assert s.routed_experts is not None, "native routing returned no routed experts"
        assert s.routed_experts.dtype == routing_dtype_for(s.num_experts)
        assert s.routed_experts.shape == (P + T - 1, L, K)
        assert int(s.routed_experts.max()) < E
        assert (np.sort(s.routed_experts, -1)[..., 1:] != np.sort(s.routed_experts, -1)[..., :-1]).all()
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 1e-6).all()
        r = decode(encode(Trajectory.of_sample(s).to_rollout("gpu-test", sampling)))
        assert r.routed_experts.shape == s.routed_experts.shape
        assert r.routed_experts.dtype == s.routed_experts.dtype
        # the prompt's routing does not depend on the sample, nor on a prefix-cache hit
        np.testing.assert_array_equal(s.routed_experts[:P], first[0].routed_experts[:P])


def hf_greedy_gap(model_dir, s) -> float:
    """How far each response token falls short of HF's argmax under `model_dir`'s
    weights (fp32, host): 0 for a greedy sample of those weights, up to ties."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids])[None].astype(np.int64))
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0, :-1].float(), -1)[s.prompt_ids.size - 1:]
    chosen = lp.gather(-1, ids[0, s.prompt_ids.size:, None])[:, 0]
    return float((lp.max(-1).values - chosen).max())


@pytest.mark.timeout(900)
def test_in_place_weight_update_switches_greedy_outputs(gpu_engine, tiny_model_dir,
                                                        sharp_model_dir, tmp_path):
    """The reload path of the service: WeightsReady -> stage, verify -> engine reload
    between steps. `sharp_model_dir` (same shapes, peaked outputs) is version 1.
    The prompt spans two KV blocks, so the prefix cache holds it from version 0:
    a reload must not let version 1 reuse KV computed by the old weights."""
    from safetensors.torch import load_file

    from rlstream.common.control.messages import WeightsReady
    from rlstream.common.weights.store import WeightStore
    from rlstream.producer.weights.reload import Reloader
    from rlstream.producer.sample import SamplingConfig
    from tests.support.hf_reference import hf_record_logprobs

    eng = gpu_engine
    greedy = SamplingConfig(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    prompt = eng.encode(PROMPT)

    def one(tag):
        eng.submit_group(prompt, 1, greedy, tag=tag)
        (s,) = run_until_done(eng)
        return s

    def announce(version: int, src) -> None:
        m = store.write(version, load_file(str(src / "model.safetensors")), src)
        assert reloader.apply(WeightsReady(version=version, transport="file", uri=m["uri"], sha256=m["sha256"],
                                           bytes=m["bytes"]))
        assert eng.version == version

    store, reloader = WeightStore(tmp_path / "weights"), Reloader(eng, tiny_model_dir)
    try:
        base = one("v0")
        announce(1, sharp_model_dir)
        new = one("v1")
        announce(2, tiny_model_dir)  # the base weights, under a new version number
        again = one("v2")
    finally:
        reloader.close()
    assert new.dispatch_version == 1 and new.token_versions == [(1, TOKENS)]
    assert not np.array_equal(base.response_ids, new.response_ids)
    assert hf_greedy_gap(sharp_model_dir, new) < 1e-3, "greedy tokens are not the new weights' argmax"
    assert np.abs(hf_record_logprobs(sharp_model_dir, new) - new.logprobs).max() < 1e-3
    assert np.abs(hf_record_logprobs(tiny_model_dir, new) - new.logprobs).max() > 1e-2  # not the old weights
    assert hf_greedy_gap(tiny_model_dir, base) < 1e-3
    np.testing.assert_array_equal(again.response_ids, base.response_ids)
    np.testing.assert_allclose(again.logprobs, base.logprobs, atol=1e-5)
    np.testing.assert_array_equal(again.routed_experts, base.routed_experts)


@pytest.mark.timeout(900)
def test_native_routing_rows_survive_preemption(tiny_model_dir, tmp_path):
    """R3 under preemption with vLLM's native routed-experts output (known to lose rows of
    preempted requests): tests/integration/test_routing_preemption.py's check, in its own
    process with a 1 MiB KV cache. Rows must cover P + T - 1 positions and replay in HF
    (host, fp32) to the GPU's log-probs within 1e-3; equality with the runs alone is
    printed, not required (GPU kernels may round differently per batch shape)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: the producer's GPU tests need upstream vLLM 0.32.0")
    from tests.support.preemption import check_preempted_routing, run_preemption_worker

    runs = run_preemption_worker(tiny_model_dir, tmp_path, "native")
    print("\npreemption (native):", check_preempted_routing(runs, tiny_model_dir, 1e-3, same_as_alone=False))
