"""GPU only: the producer's engine with vLLM's native routing (docs/producer-engine.md, "GPU path").

`producer.engine.routing: native` asks vLLM for `enable_return_routed_experts`
(Triton kernels: a CUDA GPU). On a CPU-only machine this module is skipped
(marker `gpu`, with the reason); the CPU path, routing capture, is proven in
test_routing_capture.py. On a GPU node: the engine starts on the tiny model,
samples a group, and every sample carries the routing of every input token
([P+T-1, layers, top_k], uint8), valid expert ids and log-probs <= 0, and the
sample converts into a valid record.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: routing native is vLLM's enable_return_routed_experts (Triton); "
                              "CPU machines capture routing instead (test_routing_capture.py)"),
]


@pytest.mark.timeout(900)
def test_native_routing_engine_starts_and_returns_every_input_tokens_routing(tiny_model_dir):
    from common.config import EngineSettings
    from common.record import decode, encode
    from producer.engine import RolloutEngine
    from producer.sample import SamplingConfig

    # vLLM 0.31+ needs prefix caching on for native routing; the KV cache comes from gpu_memory_utilization
    settings = EngineSettings(dtype="float32", max_model_len=256, kv_cache_memory_bytes=None,
                              gpu_memory_utilization=0.3, routing="native", enable_prefix_caching=True,
                              enforce_eager=True, seed=0)
    engine = RolloutEngine(settings, tiny_model_dir, version=0)
    try:
        sampling = SamplingConfig(max_tokens=16)
        engine.submit_group(engine.encode("12+7="), 4, sampling, tag="native")
        samples = []
        for _ in range(500):
            samples += engine.step()
            if not engine.num_in_flight:
                break
    finally:
        engine.close()
    assert len(samples) == 4
    for s in samples:
        P, T = s.prompt_ids.size, s.response_ids.size
        assert s.routed_experts is not None and s.routed_experts.dtype == np.uint8
        assert s.routed_experts.shape[0] == P + T - 1 and s.routed_experts.max() < s.num_experts
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 1e-6).all()
        r = decode(encode(s.to_rollout(0.0, {}, "gpu-test", sampling)))
        assert r.routed_experts.shape == s.routed_experts.shape
