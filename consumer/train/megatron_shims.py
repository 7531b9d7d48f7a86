"""The shims that let megatron-core 0.16.1 run where part of its stack is missing.

Each shim repairs one missing thing and is applied exactly when that thing is
missing, never on a proxy condition (a GPU node without Transformer Engine
needs shim 4 as much as the CPU test machine does):

  missing                   shim
  Transformer Engine        4. `moe_utils.te_general_gemm = None`: the router's gating
                               function reads the name, which megatron-core 0.16.1 defines
                               only when TE imports (NameError at the first MoE forward;
                               upstream sets it to None from core 0.17)
  TE's and Apex's           7. the gradient norm's fallback (`local_multi_tensor_l2_norm`)
  multi-tensor l2 norm         builds a host tensor from every parameter's norm: one
                               device-to-host sync per parameter on GPU. Replaced by one
                               `torch._foreach_norm` that stays on the gradients' device.
  CUDA                      1. `torch.cuda.current_device()` returns "cpu": the rotary
                               embedding, the router, the DDP buffers allocate on "the
                               current CUDA device"
                            3. the CUDA RNG tracker's `fork()` is a null context
                            5. `_get_cuda_rng_state` / `_set_cuda_rng_state` do nothing:
                               activation recompute saves and restores the CUDA RNG state
                               (the CPU RNG state is still saved and restored)
                            6. `cuda_as_cpu()`: a TorchFunctionMode that reads device="cuda"
                               as the CPU, makes `Tensor.cuda()` the identity and names CPU
                               tensors' `.type()` as CUDA ones (the optimizer's dtype checks
                               compare those strings). Entered only around the optimizer's
                               own calls (`wrap_optimizer`), never around forward/backward.
  (2. is a calling convention: `causal_attention_mask()` below, passed by consumer.model to
   Megatron's local attention, whose default mask is built on "cuda".)

`apply()` is idempotent and returns the names of the shims active in this process.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

from rlstream.common.gpu_standin import device as standin_device

TE_SHIMS = ("te_general_gemm",)
NORM_SHIMS = ("l2_norm",)
CPU_SHIMS = ("current_device", "rng_fork", "cuda_rng_state", "cuda_as_cpu")
_applied: set[str] = set()


def cuda_available() -> bool:
    """True when a real CUDA device is present (then no CPU shim is applied)."""
    return torch.cuda.is_available()


def te_gemm_missing() -> bool:
    """True when megatron-core left `te_general_gemm` undefined (Transformer Engine absent)."""
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def fused_l2_norm_missing() -> bool:
    """True when the gradient norm falls back to megatron-core's host-side l2 norm."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    return clip_grads.l2_norm_impl is local_multi_tensor_l2_norm


def needed(cuda: bool, te_gemm_missing: bool, fused_l2_norm_missing: bool = False) -> list[str]:
    """The shims a process with these conditions needs, by name."""
    return (([*TE_SHIMS] if te_gemm_missing else [])
            + ([*NORM_SHIMS] if fused_l2_norm_missing else []) + ([] if cuda else [*CPU_SHIMS]))


def apply() -> frozenset[str]:
    """Apply each shim this process needs, once; return the names of those active."""
    for name in needed(cuda_available(), te_gemm_missing(), fused_l2_norm_missing()):
        if name not in _applied:
            _APPLY[name]()
            _applied.add(name)
    return frozenset(_applied)


def _te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _rng_fork() -> None:
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random.CudaRNGStatesTracker.fork = (  # type: ignore[assignment]
        lambda self, name=None: contextlib.nullcontext())


def _cuda_rng_state() -> None:
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *a, **k: None
    mpu_random._set_cuda_rng_state = lambda *a, **k: None


def _device_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """`local_multi_tensor_l2_norm` (same contract: ([1] fp32 norm, None)) without its
    host round trip per tensor."""
    tensors = [t for group in tensor_lists for t in group]
    norms = torch.stack(torch._foreach_norm(tensors)).float()
    return torch.linalg.vector_norm(norms).reshape(1), None


def _l2_norm() -> None:
    from megatron.core.optimizer import clip_grads

    clip_grads.l2_norm_impl = _device_l2_norm


_APPLY = {"te_general_gemm": _te_general_gemm, "l2_norm": _l2_norm, "current_device": _current_device,
          "rng_fork": _rng_fork, "cuda_rng_state": _cuda_rng_state,
          "cuda_as_cpu": lambda: None}  # a context, entered by wrap_optimizer


# ---------------------------------------------------------------- shim 6: the optimizer on CPU


def _cpu_device(d):
    if isinstance(d, str) and d.startswith("cuda"):
        return "cpu"
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    if isinstance(d, int):  # an ordinal, as torch.cuda.current_device() returns on GPU
        return "cpu"
    return d


class CudaAsCpu(TorchFunctionMode):
    """Megatron's optimizer code on the CPU: literal device="cuda" factory calls
    (optimizer.py, clip_grads.py), `Tensor.cuda()`, and the legacy type-string
    checks (`param.type() == 'torch.cuda.FloatTensor'`, distrib_optimizer.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if standin_device.active():  # the GPU stand-in's device memory places tensors itself
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            text = func(*args)
            return text if args[0].is_cuda else text.replace("torch.", "torch.cuda.", 1)
        if name == "to" and len(args) > 1:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def cuda_as_cpu():
    """Shim 6 as a context: CudaAsCpu without CUDA, nothing with it."""
    return contextlib.nullcontext() if cuda_available() else CudaAsCpu()


OPTIMIZER_CALLS = ("step", "zero_grad", "state_dict", "load_state_dict", "get_grad_norm",
                   "get_parameter_state_dp_zero", "load_parameter_state_from_dp_zero")


def wrap_optimizer(opt):
    """Enter `cuda_as_cpu()` around the public calls of a Megatron optimizer (and of
    each optimizer it chains); without CUDA only, a no-op with it."""
    if cuda_available():
        return opt
    for target in [opt, *getattr(opt, "chained_optimizers", [])]:
        for name in OPTIMIZER_CALLS:
            method = getattr(target, name, None)
            if method is not None:
                setattr(target, name, _inside_cuda_as_cpu(method))
    return opt


def _inside_cuda_as_cpu(method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        with CudaAsCpu():
            return method(*args, **kwargs)
    return call


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Shim 2: Megatron's boolean mask, shape [1, 1, S, S], True = masked out."""
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1).view(1, 1, seq_len, seq_len)
