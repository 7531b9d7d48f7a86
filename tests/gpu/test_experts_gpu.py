"""Grouped-GEMM experts vs SequentialMLP on one GPU (issue 26 item 6, consumer/train/experts.py):
the same bf16 train_step with `consumer.memory.experts` grouped and sequential, on a
MoE-heavy model (64 experts, top-8, Qwen3-30B-A3B's expert width 768), timed.

    .venv/bin/python -m pytest -m gpu tests/gpu/test_experts_gpu.py -s   # -s prints the JSON

Skipped with the reason where CUDA or megatron-core is absent (tests/gpu/conftest.py).
The printed figures go to docs/gpu.md only once measured on a GPU.
"""
from __future__ import annotations

import json
import math
import statistics
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.usefixtures("needs_megatron"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MOE = dict(vocab_size=32768, hidden_size=1024, moe_intermediate_size=768, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=64,
           num_experts_per_tok=8, max_position_embeddings=32768)
TOKENS, WARMUP, TIMED = 8192, 2, 5


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "m", TinyModelSpec(**MOE))


def step_seconds(model_dir, experts: str) -> tuple[str, float, torch.Tensor]:
    """(chosen kind, median seconds of a bf16 train_step on one TOKENS-long sequence,
    log-probs of a fixed batch before any update)."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.model import per_token_logprobs
    from rlstream.consumer.train.trainer import Trainer
    from tests.bench.trainer_scale import SCALED, one_sample

    trainer = Trainer.from_hf(model_dir, ConsumerSettings(
        group_size=1, dtype="bfloat16", optimizer={"lr": 1e-6},
        memory={**SCALED, "micro_batch_tokens": TOKENS, "experts": experts}))
    tokens = torch.randint(3, MOE["vocab_size"], (2, 257), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = per_token_logprobs(trainer.model, tokens).float().cpu()
    gb = trainer.build_batch([one_sample(TOKENS, MOE["vocab_size"])], 1)
    times = []
    for i in range(WARMUP + TIMED):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = trainer.train_step(gb)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    kind = trainer.model.experts
    del trainer, gb
    torch.cuda.empty_cache()
    return kind, statistics.median(times[WARMUP:]), lp


def test_grouped_experts_step_time_vs_sequential(moe_model_dir):
    seq_kind, seq_s, seq_lp = step_seconds(moe_model_dir, "sequential")
    grp_kind, grp_s, grp_lp = step_seconds(moe_model_dir, "grouped")
    print("\n" + json.dumps({
        "bench": "gpu_grouped_experts", "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "model": MOE, "dtype": "bfloat16", "tokens": TOKENS,
        "grouped_kind": grp_kind, "sequential_step_s": round(seq_s, 4),
        "grouped_step_s": round(grp_s, 4), "speedup": round(seq_s / grp_s, 3)}))
    assert seq_kind == "sequential" and grp_kind in ("te_grouped", "torch_grouped")
    assert float((seq_lp - grp_lp).abs().max()) < 5e-2  # bf16 kernels differ in rounding only


@pytest.mark.parametrize("counts", [[0] * 8, [3, 0, 5] + [0] * 5])
def test_grouped_mm_on_cuda_with_experts_that_receive_no_token(counts):
    """An expert-parallel rank whose experts get no token (all counts 0), and experts left empty
    among busy ones: torch._grouped_mm forward and backward on CUDA in bf16 at Qwen3-30B-A3B's
    widths (hidden 2048, expert FFN 768), the gradients finite and zero exactly where no row went.
    Checked on CPU in tests/integration/test_megatron_model.py; the CUDA kernel is another code path."""
    from rlstream.consumer.train.experts import _grouped_mm

    hidden, ffn, rows = 2048, 768, sum(counts)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w1 = torch.randn(len(counts), hidden, 2 * ffn, device="cuda", dtype=torch.bfloat16, generator=g,
                     requires_grad=True)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = _grouped_mm(x, w1, offs)
    out.sum().backward()
    torch.cuda.synchronize()
    assert out.shape == (rows, 2 * ffn) and torch.isfinite(w1.grad.float()).all()
    for e, n in enumerate(counts):
        assert bool(w1.grad[e].abs().sum() > 0) == (n > 0), (e, n)
