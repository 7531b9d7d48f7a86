"""`auto` is made concrete by one rule for the trainer and the producers."""
from rlstream.common.weights.backends import GLOO, NCCL, resolve


def test_auto_is_nccl_on_a_gpu_and_gloo_on_cpu_for_both_roles():
    from rlstream.consumer.service import _weight_backend
    from rlstream.common.config import EngineSettings
    from rlstream.producer.vllm_args import resolve_weight_transfer

    assert resolve("auto", on_gpu=True) == NCCL and resolve("auto", on_gpu=False) == GLOO
    assert resolve(NCCL, on_gpu=False) == NCCL  # explicit settings are kept (the stand-ins)
    assert resolve_weight_transfer(EngineSettings(weight_transfer="auto"), on_cpu=True) == GLOO
    assert resolve_weight_transfer(EngineSettings(weight_transfer="auto"), on_cpu=False) == NCCL
    import torch

    assert _weight_backend("auto") == (NCCL if torch.cuda.is_available() else GLOO)
