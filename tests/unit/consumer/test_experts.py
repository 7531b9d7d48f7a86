"""consumer/train/experts.py: the choice of the MoE experts kernel and the grouped weights'
per-expert names (the model-level equality test is in tests/integration/test_megatron_model.py)."""
from __future__ import annotations

import pytest
import torch

from rlstream.common.errors import ConfigError
from rlstream.consumer.train import experts


def kernel_metric() -> dict[str, float]:
    from rlstream.common.metrics import REGISTRY

    return {k: REGISTRY.get_sample_value("rlstream_trainer_experts_kernel", {"kind": k})
            for k in experts.KINDS}


def test_sequential_on_request_and_grouped_where_the_probe_passes():
    assert experts.resolve("sequential", 128, 64, torch.float32) == "sequential"
    assert kernel_metric() == {"te_grouped": 0.0, "torch_grouped": 0.0, "sequential": 1.0}
    if not experts.te_available():  # CPU: torch's grouped matmul
        assert experts.resolve("auto", 128, 64, torch.float32) == "torch_grouped"
        assert experts.resolve("grouped", 128, 64, torch.float32) == "torch_grouped"
        assert kernel_metric()["torch_grouped"] == 1.0 and kernel_metric()["sequential"] == 0.0


def test_an_old_transformer_engine_is_not_taken_for_te_grouped(monkeypatch):
    """TE importable and CUDA present, but a TE older than 1.7: Megatron has no TE grouped linear
    layers and would build the legacy GroupedMLP, which asserts the grouped_gemm package."""
    import importlib.util

    from megatron.core.extensions import transformer_engine as te_layers

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else found(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(experts, "torch_grouped_mm_works", lambda *a, **k: None)  # the probe needs no GPU here
    monkeypatch.setattr(te_layers, "TEColumnParallelGroupedLinear", None)
    assert not experts.te_available()
    assert experts.resolve("auto", 128, 64, torch.bfloat16) != "te_grouped"
    monkeypatch.setattr(te_layers, "TEColumnParallelGroupedLinear", object)  # TE >= 1.7
    assert experts.te_available()


def test_grouped_refused_with_a_reason_auto_falls_back(monkeypatch):
    """Rows of 6 fp32 (24 bytes) break torch._grouped_mm's 16-byte stride rule."""
    monkeypatch.setattr(experts, "te_available", lambda: False)
    assert "16 bytes" in experts.torch_grouped_mm_works(6, 6, torch.float32)
    assert experts.resolve("auto", 6, 6, torch.float32) == "sequential"
    with pytest.raises(ConfigError, match="no grouped GEMM") as e:
        experts.resolve("grouped", 6, 6, torch.float32)
    assert e.value.key == "consumer.memory.experts"
    with torch.no_grad():  # the probe's backward is not fooled by a caller's no_grad
        assert experts.torch_grouped_mm_works(128, 64, torch.float32) is None
    with pytest.raises(ConfigError, match="unknown experts"):
        experts.resolve("fast", 128, 64, torch.float32)


def test_te_grouped_names_become_sequential_names():
    """TEGroupedMLP keeps one [2 * ffn, hidden] weight per expert: a rename only."""
    w = torch.randn(8, 4)
    state = {"decoder.layers.2.mlp.experts.linear_fc1.weight11": w,
             "decoder.layers.2.mlp.router.weight": torch.zeros(3)}
    out = experts.sequential_names(state, torch.nn.Module())
    assert set(out) == {"decoder.layers.2.mlp.experts.local_experts.11.linear_fc1.weight",
                        "decoder.layers.2.mlp.router.weight"}
    assert out["decoder.layers.2.mlp.experts.local_experts.11.linear_fc1.weight"] is w
