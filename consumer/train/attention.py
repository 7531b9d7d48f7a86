"""Core attention of the trainer's layers (`consumer.memory.attention`).

    name = resolve("auto")            # "te" when Transformer Engine imports, else "sdpa"
    module = core_attention(name)     # the core_attention submodule of the layer spec

  te     Transformer Engine's `TEDotProductAttention` (fused flash/cuDNN kernels, causal
         without a mask). Only the core attention changes: the rest of the layer stays
         Megatron's local spec, so parameter names and the HF converter are unchanged.
         (TE's whole layer spec - fused norm+linear, grouped-GEMM experts - would change
         the parameter layout; not used.)
  sdpa   `SDPAttention` below: torch's scaled_dot_product_attention (flash or memory-
         efficient kernels on GPU, the flash kernel on CPU), causal by construction.
         Memory is linear in the sequence: no [heads, S, S] scores.
  local  Megatron's `DotProductAttention`: [b * heads, S, S] scores and probabilities
         kept for backward (quadratic), and an explicit [1, 1, S, S] mask.

te and sdpa ignore the attention mask: rlstream's mask is always plain causal and right
padding never influences real positions, so consumer.model passes none to them.
Measured on the tiny model (fp32, CPU): sdpa vs local log-probs within 4.8e-7, gradients
within 3.4e-8 (tests/integration/test_trainer_memory.py checks 1e-5).
"""
from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from rlstream.common.errors import ConfigError

IMPLEMENTATIONS = ("te", "sdpa", "local")


def te_available() -> bool:
    """Transformer Engine is importable (its attention needs CUDA)."""
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def resolve(name: str) -> str:
    """The implementation `consumer.memory.attention` names; auto: te if available, else sdpa."""
    if name == "auto":
        return "te" if te_available() else "sdpa"
    if name == "te" and not te_available():
        raise ConfigError("consumer.memory.attention=te needs transformer_engine and CUDA; "
                          "use auto or sdpa", "consumer.memory.attention")
    if name not in IMPLEMENTATIONS:
        raise ConfigError(f"unknown attention {name!r}; use auto, te, sdpa or local",
                          "consumer.memory.attention")
    return name


def core_attention(name: str):
    """The module class for the layer spec's `core_attention` (name already resolved)."""
    if name == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if name == "sdpa":
        return SDPAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def needs_mask(name: str) -> bool:
    """Only Megatron's local attention reads the explicit causal mask."""
    return name == "local"


class SDPAttention(MegatronModule):
    """Drop-in for Megatron's DotProductAttention (same constructor and forward)
    on `torch.nn.functional.scaled_dot_product_attention`, causal."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = (softmax_scale if softmax_scale is not None
                      else 1.0 / math.sqrt(config.kv_channels))
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: no packed sequences or attention bias")
        seq, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s,b,n,d] -> [b,n,s,d]
        repeat = self.heads // self.groups
        if repeat > 1:  # grouped-query attention: repeat kv heads (keeps every backend eligible)
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
