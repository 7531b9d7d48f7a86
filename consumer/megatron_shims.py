"""The four shims that let megatron-core 0.16.1 run on CPU (gloo, no CUDA).

Megatron-core assumes CUDA in a few places. On a CPU-only machine (the test
machine, CI) rlstream applies exactly these, each one measured on the CPU test machine:

1. `torch.cuda.current_device()` returns ``"cpu"`` - the rotary embedding,
   the router and a few buffers allocate on "the current CUDA device".
2. An explicit causal attention mask: the default mask is built on "cuda".
   This is a calling convention, not a patch: `causal_attention_mask()` below
   builds it and `consumer.model` always passes it.
3. The CUDA RNG tracker's `fork()` is a null context (there is no CUDA RNG
   state to fork; dropout is 0 in rlstream's configs anyway).
4. `megatron.core.transformer.moe.moe_utils.te_general_gemm = None`: the name
   is only defined when Transformer Engine imports, yet the router's gating
   function reads it unconditionally.

`apply()` is idempotent and does nothing when CUDA is available, so the same
code runs unchanged on GPU nodes with NCCL.
"""
from __future__ import annotations

import contextlib

import torch

_APPLIED = False


def cuda_available() -> bool:
    """True when a real CUDA device is present (then no shim is applied)."""
    return torch.cuda.is_available()


def apply() -> bool:
    """Apply the CPU shims once; return True if they are (now) active."""
    global _APPLIED
    if cuda_available():
        return False
    if _APPLIED:
        return True
    # 1. "current CUDA device" is the CPU.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # 3. No CUDA RNG state to fork.
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random.CudaRNGStatesTracker.fork = (  # type: ignore[assignment]
        lambda self, name=None: contextlib.nullcontext())
    # 4. Missing name when Transformer Engine is absent.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED = True
    return True


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Shim 2: Megatron's boolean mask, shape [1, 1, S, S], True = masked out."""
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1).view(1, 1, seq_len, seq_len)
