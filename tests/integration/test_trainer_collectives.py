"""Every collective the trainer issues carries tensors on the device its group
serves (B3: NCCL takes CUDA tensors only), checked on 2 CPU ranks with a meta
default device (tests/support/collectives.py explains why that bites on CPU);
and the step makes no host synchronisation per parameter (m4)."""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from tests.support.multirank import run_worker_layouts

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
AUDITS = ["audit-dp2_ep2", "audit-tp2"]


@pytest.fixture(scope="module")
def audits(sharp_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    run_worker_layouts(sharp_model_dir, out, 2, AUDITS)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in AUDITS}


@pytest.mark.parametrize("name", AUDITS)
def test_every_collective_is_on_its_groups_device(audits, name):
    a = audits[name]
    assert a["calls"] > 10 and "all_reduce" in a["names"], a  # metrics, gradients, norms
    # the distributed optimizer: gradient reduce-scatter and parameter all-gather
    # (Megatron's aliases)
    assert {"dist_reduce_scatter_func", "dist_all_gather_func"} <= set(a["names"]), a
    # a checkpoint's state gathers nothing: each rank saves its own shard (N7b; it was a
    # gather of every rank's masters and moments to data-parallel rank 0, over gloo)
    assert a["checkpoint_calls"] == [], a
    assert a["misplaced"] == [], a
    # negative control: the old metric reduction (a device-less float64 tensor) is caught
    assert a["old_misplaced"] == 1


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls in rlstream's own code (consumer/) that copy a tensor's
    value to the host. Megatron's are its own: one per MoE layer and forward
    (dropless dispatch sizes its expert split on the host), and torch AdamW
    reads its step counters, host scalars, per parameter."""

    NAMES = {"item", "cpu", "tolist", "__float__", "__int__", "__bool__", "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES and self._from_consumer():
            self.count += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _from_consumer() -> bool:
        caller = next(f for f in reversed(traceback.extract_stack()[:-2])  # skip modes' dispatch
                      if f"{os.sep}torch{os.sep}" not in f.filename and f.name != "__torch_function__")
        return f"{os.sep}consumer{os.sep}" in caller.filename


def host_syncs_of_a_step(model_dir, samples) -> int:
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    trainer = Trainer.from_hf(model_dir, ConsumerSettings(replay="R3", num_minibatches=2))
    gb = trainer.build_batch(samples, 4)
    with HostSyncs() as syncs:
        trainer.train_step(gb)
    return syncs.count


def test_host_syncs_do_not_grow_with_the_parameter_count(megatron_world, tmp_path):
    """The same step on a model with 2 layers x 8 experts and one with 4 layers x
    16 experts (3.6x the parameter tensors): the same number of host syncs in
    rlstream's code. (The old clip_grad_norm made one `.cpu()` per parameter
    tensor; Megatron's gradient norm is kept on the device by shim 7.)"""
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from tests.integration.multirank_worker import make_samples

    small = build_tiny_model(tmp_path / "small")
    big = build_tiny_model(tmp_path / "big", TinyModelSpec(num_hidden_layers=4, num_experts=16))
    counts = [host_syncs_of_a_step(d, make_samples(str(d))) for d in (small, big)]
    assert counts[0] == counts[1] and counts[0] < 100, counts
