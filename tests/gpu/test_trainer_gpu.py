"""The trainer's GPU-only paths (issue #14): a bf16 step on CUDA with NCCL, the
Transformer Engine attention build, and linear peak-memory growth on a mid-size
MoE. Skipped, with the reason, where CUDA (or TE) is absent. Run in a session
of their own, so that the process group is NCCL's:

    .venv/bin/python -m pytest -m gpu tests/gpu
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MID = dict(vocab_size=32768, hidden_size=512, moe_intermediate_size=512, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16,
           num_experts_per_tok=4, max_position_embeddings=32768)


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory):
    from common.toy.tinymodel import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("mid") / "m", TinyModelSpec(**MID))


def one_sequence(tokens: int, vocab: int, seed: int = 0):
    import numpy as np

    from consumer.batch import TrainSample

    rng = np.random.default_rng(seed)
    resp = rng.integers(3, vocab, tokens - 15).astype(np.int32)
    return TrainSample(prompt_ids=rng.integers(3, vocab, 16).astype(np.int32), response_ids=resp,
                       logprobs=np.full(len(resp), -3.0, np.float32), reward=1.0, group_id="g")


def test_bf16_step_on_cuda_with_nccl(tiny_model_dir):
    import torch.distributed as dist

    from common.config import ConsumerSettings
    from consumer import megatron_shims
    from consumer.trainer import Trainer
    from tests.integration.multirank_worker import make_samples

    trainer = Trainer.from_hf(tiny_model_dir, ConsumerSettings(
        dtype="bfloat16", replay="R3", num_minibatches=2, optimizer={"lr": 1e-6},
        memory={"micro_batch_tokens": 24, "recompute": True}))
    assert dist.get_backend() == "nccl" and trainer.device.type == "cuda"
    assert not set(megatron_shims.CPU_SHIMS) & megatron_shims.apply()
    before = {p: m.clone() for p, m in trainer.optimizer.fp32_masters().items()}
    metrics = trainer.train_step(trainer.build_batch(make_samples(str(tiny_model_dir)), 4))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    moved = [not torch.equal(before[p], m) for p, m in trainer.optimizer.fp32_masters().items()]
    assert sum(moved) > 0.9 * len(moved)  # lr 1e-6 moves the fp32 masters


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="Transformer Engine is not installed (not in the gpu extra)")
def test_te_attention_builds_and_matches_sdpa(tiny_model_dir):
    from consumer.model import load_hf_checkpoint, per_token_logprobs

    te = load_hf_checkpoint(tiny_model_dir, dtype=torch.bfloat16, attention="te")
    sdpa = load_hf_checkpoint(tiny_model_dir, dtype=torch.bfloat16, attention="sdpa")
    tokens = torch.randint(3, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = per_token_logprobs(te, tokens), per_token_logprobs(sdpa, tokens)
    assert float((a - b).abs().max()) < 5e-2  # bf16 kernels differ in rounding only


def peak_cuda_bytes(model_dir, tokens: int) -> int:
    from common.config import ConsumerSettings
    from consumer.trainer import Trainer

    trainer = Trainer.from_hf(model_dir, ConsumerSettings(
        group_size=1, dtype="bfloat16", optimizer={"lr": 1e-6},
        memory={"micro_batch_tokens": tokens, "recompute": True, "attention": "auto"}))
    vocab = trainer.model.hf_dims.vocab_size
    trainer.train_step(trainer.build_batch([one_sequence(64, vocab, 1)], 1))  # optimizer state
    gb = trainer.build_batch([one_sequence(tokens, vocab)], 1)
    torch.cuda.synchronize()
    idle = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(gb)
    return torch.cuda.max_memory_allocated() - idle


def test_peak_memory_grows_linearly_with_tokens(mid_model_dir):
    small, large = peak_cuda_bytes(mid_model_dir, 4096), peak_cuda_bytes(mid_model_dir, 16384)
    exponent = math.log(large / small) / math.log(4)
    assert exponent <= 1.2, (small, large, exponent)
