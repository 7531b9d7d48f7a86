"""Resume with the optimizer CPU offload: Megatron's HybridDeviceOptimizer (HDO), its own
Python, on CPU over the GPU stand-ins (common/gpu_standin/: CUDA streams, pinned memory,
and device memory, so the model's parameters count as GPU-resident and HDO offloads half
of them, as `cpu_offload_fraction: 0.5` does on a GPU).

A checkpoint's per-rank state (consumer/train/optimizer.py state_dict, split_rank_state, host
copies as `map_location="cpu"` loads them) loaded into a fresh optimizer must leave
- every sub-optimizer's fp32 parameter equal to the checkpoint's master,
- every state tensor on its parameter's device,
- the model's weights as they were saved (loading runs HDO's dummy step on random grads),
and the next step must run.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron


@pytest.fixture
def device_memory():
    from rlstream.common import gpu_standin
    from rlstream.common.gpu_standin.device import device_memory

    with gpu_standin.installed(), device_memory():
        yield


def offloading(model_dir):
    from rlstream.common.config import OptimizerSettings
    from rlstream.common.gpu_standin.device import place
    from rlstream.consumer.train.model import load_hf_checkpoint
    from rlstream.consumer.train.optimizer import TrainerOptimizer

    model = load_hf_checkpoint(model_dir, dtype=torch.bfloat16)
    place(model.parameters())  # loaded onto the GPU
    cfg = OptimizerSettings(name="adamw", distributed=True, cpu_offload_fraction=0.5, lr=1e-2)
    return model, TrainerOptimizer(model, cfg)


def step(model, opt) -> float:
    opt.zero_grad()
    with opt.accumulating(last=True):
        loss = sum((p.float() ** 2).sum() * 1e-3 for p in model.parameters())
        loss.backward()
    return opt.step()


def test_a_resume_with_optimizer_offload_keeps_masters_devices_and_weights(megatron_world, tiny_model_dir,
                                                                          device_memory):
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from torch.utils._pytree import tree_map

    from rlstream.common.gpu_standin.device import on_device
    from rlstream.consumer.train.optimizer import join_rank_state, split_rank_state

    model, opt = offloading(tiny_model_dir)
    hdo = opt.parts[0].optimizer
    assert isinstance(hdo, HybridDeviceOptimizer) and hdo.cpu_optimizers and hdo.gpu_optimizer is not None
    step(model, opt), step(model, opt)
    shared, own = split_rank_state(opt.state_dict())
    saved = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, join_rank_state(shared, own))
    masters = [hdo.state[p]["master_param"].clone() for p in _params(hdo)]
    weights = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = offloading(tiny_model_dir)
    with torch.no_grad():
        for p, w in zip(model2.parameters(), weights):
            p.copy_(w)  # the checkpoint's model weights, loaded before the optimizer's state
    opt2.load_state_dict(saved)
    hdo2 = opt2.parts[0].optimizer

    moved = [i for i, (p, w) in enumerate(zip(model2.parameters(), weights)) if not torch.equal(p, w)]
    assert not moved, f"{len(moved)} of {len(weights)} weights moved by loading the optimizer's state"
    stale = [i for i, (p, master) in enumerate(zip(_params(hdo2), masters))
             if not torch.equal(hdo2.param_to_inner_param[p], master)]
    assert not stale, f"{len(stale)} of {len(masters)} sub-optimizer fp32 copies are not the saved masters"
    misplaced = [(k, on_device(v), on_device(param)) for sub in hdo2.sub_optimizers
                 for param, state in sub.state.items() for k, v in state.items()
                 if isinstance(v, torch.Tensor) and on_device(v) != on_device(param)]
    assert not misplaced, f"{len(misplaced)} state tensors on another device than their parameter: {misplaced[:4]}"
    assert step(model2, opt2) > 0


def _params(hdo) -> list:
    """HDO's parameters in group order (the same order in two optimizers of one model)."""
    return [p for g in hdo.param_groups for p in g["params"]]
