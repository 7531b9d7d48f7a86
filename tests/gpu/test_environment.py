"""The GPU machine itself: the facts every other GPU test relies on."""
from __future__ import annotations


def test_cuda_torch_with_nccl():
    import torch
    import torch.distributed as dist

    assert torch.version.cuda, "a CPU-only torch on a GPU machine (see ops/doctor.py --gpu)"
    assert dist.is_nccl_available(), "torch was built without NCCL"
    x = torch.ones(1024, device="cuda")
    assert float(x.sum()) == 1024.0


def test_megatron_shims_apply_only_what_the_machine_lacks(needs_megatron):
    """On CUDA no CPU shim is active, and the Transformer-Engine shim is applied exactly
    when TE is absent (the review's B2: megatron-core 0.16.1 without TE leaves
    te_general_gemm undefined and the first router forward raises NameError)."""
    import importlib.util

    import torch
    from megatron.core.transformer.moe import moe_utils

    from rlstream.consumer.train import megatron_shims

    megatron_shims.apply()
    assert torch.cuda.current_device() != "cpu"  # shim 1 is CPU-only
    if importlib.util.find_spec("transformer_engine") is None:
        assert hasattr(moe_utils, "te_general_gemm")
