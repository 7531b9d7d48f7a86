"""The weight export of a sharded trainer, over a weight link (consumer/train/export.py):
under torchrun (gloo, CPU) with data 2 x expert 2, tensor 2, and tensor 2 x data 2 x
expert 2, what a producer receives equals the single-process export bit for bit, in the
same layer groups, with the same version digest. After a training step under Megatron's
distributed optimizer (optimizer state sharded over the data-parallel ranks) the ranks
stream the updated model weights: the trainer's own export of them, and one process's
step on the same batch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
WORKER = Path(__file__).with_name("weights_multirank_worker.py")
REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"dp2_ep2": 2, "tp2": 2, "tp2_dp2_ep2": 4}


@pytest.fixture(scope="module")
def one_rank(megatron_world, sharp_model_dir):
    """The single-process export of the same checkpoint, packed the same way."""
    from rlstream.consumer.train.trainer import Trainer
    from rlstream.consumer.weights.snapshot import Snapshot

    trainer = Trainer.from_hf(sharp_model_dir)
    snap = Snapshot(1, trainer.weight_source())
    snap.fill()
    return {k: t.clone() for k, t in snap.tensors().items()}, snap.digest, [g.names for g in snap.header.groups]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_what_a_producer_receives_from_sharded_ranks_is_the_single_process_export(one_rank, sharp_model_dir,
                                                                                   layout, tmp_path):
    from rlstream.consumer.train.layout import read_hf_safetensors

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(LAYOUTS[layout]), str(WORKER),
           str(sharp_model_dir), str(tmp_path), layout]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / f"{layout}.pt", weights_only=True)
    want, digest, groups = one_rank
    assert got["groups"] == groups and got["digest"] == got["sent"] == digest
    assert set(got["tensors"]) == set(want)
    for k, v in want.items():
        assert torch.equal(got["tensors"][k], v), k
    disk = read_hf_safetensors(sharp_model_dir)  # and that is the checkpoint the shards were cut from
    assert all(torch.equal(want[k], disk[k]) for k in disk)


@pytest.mark.timeout(900)
def test_after_a_distributed_optimizer_step_producers_receive_the_updated_model_weights(
        megatron_world, sharp_model_dir, tmp_path):
    """dp2 x ep2, one step of test_multirank.py's (AdamW, distributed optimizer, micro-batches):
    the link carries exactly the trainer's `export_hf_state_dict` (the path test_multirank.py
    checks against one process), equal to one process's step to test_multirank.py's 1e-6, and
    the step moved the weights far beyond that."""
    from rlstream.consumer.train.layout import read_hf_safetensors
    from rlstream.consumer.train.trainer import Trainer

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(sharp_model_dir), str(tmp_path), "dp2_ep2_step"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "dp2_ep2_step.pt", weights_only=True)
    assert got["digest"] == got["sent"]
    assert set(got["tensors"]) == set(got["exported"])
    for k, v in got["exported"].items():
        assert torch.equal(got["tensors"][k], v), k
    spec = importlib.util.spec_from_file_location("multirank_worker", WORKER.with_name("multirank_worker.py"))
    mw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mw)
    one = Trainer.from_hf(sharp_model_dir, mw.trainer_config("dp2_ep2", one_rank=True))
    one.train_step(one.build_batch(mw.make_samples(sharp_model_dir), group_size=4))
    want = one.export_hf_state_dict()
    original = read_hf_safetensors(sharp_model_dir)
    for k, v in want.items():
        torch.testing.assert_close(got["tensors"][k], v, rtol=0, atol=1e-6)
    moved = max(float((got["tensors"][k] - original[k]).abs().max()) for k in original)
    assert moved > 1000 * 1e-6
