"""Session fixtures for the producer area (see tests/conftest.py).

ONE vLLM CPU engine per test session (engine start is seconds to ~40 s on the
2-core machine): `vllm_engine` builds it on `tiny_model_dir` in fp32 with a
64 MiB KV cache; `rollout_engine` hands it to one test and afterwards aborts
leftovers and reloads the base weights if the test changed them, so tests
do not depend on their order.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """The session's RolloutEngine (fp32, CPU routing capture, version 0 = tiny_model_dir)."""
    from common.config import EngineSettings
    from producer.engine import RolloutEngine

    settings = EngineSettings(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
                              max_num_seqs=32, seed=0, enforce_eager=True)
    engine = RolloutEngine(settings, tiny_model_dir, version=0)
    yield engine
    engine.close()


@pytest.fixture
def rollout_engine(vllm_engine, tiny_model_dir):
    """The session engine, reset to base weights (version 0) and no requests after the test."""
    yield vllm_engine
    vllm_engine.abort_all()
    for _ in range(100):  # let aborted requests drain out of the scheduler
        if not vllm_engine.has_work():
            break
        vllm_engine.step()
    if vllm_engine.version != 0:
        vllm_engine.reload_weights(tiny_model_dir, 0)
