"""The weight-transfer backends by name, and `auto` made concrete: one rule for both roles.

`rlstream_gloo` is ours (a gloo chain with per-group digests: consumer/weights/gloo.py
on the trainer, producer/weights/worker/gloo_engine.py in vLLM's workers); `nccl` is vLLM's
`NCCLWeightTransferEngine` (on CPU only over the test stand-ins, common/gpu_standin/).
"""
from __future__ import annotations

GLOO = "rlstream_gloo"
NCCL = "nccl"
BACKENDS = (GLOO, NCCL)


def resolve(setting: str, on_gpu: bool) -> str:
    """`auto` -> nccl on a GPU, rlstream_gloo on CPU; any other setting as it is (the
    stand-ins are chosen by setting nccl explicitly, never by auto)."""
    if setting != "auto":
        return setting
    return NCCL if on_gpu else GLOO
