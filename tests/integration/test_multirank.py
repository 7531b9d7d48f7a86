"""CPU processes under torchrun (gloo): data-parallel 2, data-parallel 2 with
expert-parallel 2, tensor-parallel 2 (sequence parallel, with R2 and R3), and
on 4 processes tensor 2 x data 2 x expert 2, each rank cutting its mini-batches
into micro-batches and sharding the optimizer state (distributed optimizer),
give the same updated weights and metrics as one process on the whole,
unsplit batch."""
from __future__ import annotations

import pytest
import torch

from tests.support.multirank import load_worker, run_worker

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def multi_rank_results(sharp_model_dir, tmp_path_factory):
    results = run_worker(sharp_model_dir, tmp_path_factory.mktemp("multirank2"), 2)
    results.update(run_worker(sharp_model_dir, tmp_path_factory.mktemp("multirank4"), 4))
    return results


@pytest.fixture(scope="module")
def one_rank_results(megatron_world, sharp_model_dir):
    """Per replay mode: the same step in this (world-of-one) process."""
    from rlstream.consumer.train.trainer import Trainer

    worker, out = load_worker(), {}
    samples = worker.make_samples(sharp_model_dir)
    for layout in ("dp2", "tp2_r3"):  # one per replay mode
        cfg = worker.trainer_config(layout, one_rank=True)
        trainer = Trainer.from_hf(sharp_model_dir, cfg)
        metrics = trainer.train_step(trainer.build_batch(samples, group_size=4))
        out[cfg.replay] = {"state": trainer.export_hf_state_dict(), "metrics": metrics}
    return out


@pytest.mark.parametrize("layout", ["dp2", "dp2_ep2", "tp2", "tp2_r3", "tp2_dp2_ep2"])
def test_same_weights_as_one_process(multi_rank_results, one_rank_results, sharp_model_dir, layout):
    from rlstream.consumer.train.layout import read_hf_safetensors
    from rlstream.consumer.train.model import read_hf_dims

    replay = load_worker().LAYOUTS[layout][2]
    got, want = multi_rank_results[layout], one_rank_results[replay]
    original = read_hf_safetensors(sharp_model_dir)
    assert set(got["state"]) == set(want["state"])
    # Adam with eps 10, so a weight's change is ~0.05 x its (clipped) gradient:
    # the layouts agree to ~1.5e-8 (measured; float32 summation order), the step
    # moves weights by ~4e-3. (With a small eps Adam's first step is
    # ~lr * sign(grad), which turns summation noise in near-zero gradients into
    # differences of ~1e-4.)
    for k, v in want["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=0, atol=1e-6)
    moved = max(float((want["state"][k] - original[k]).abs().max()) for k in original)
    assert moved > 1000 * 1e-6
    for key in ("loss", "kl_train_inference", "grad_norm", "is_weight_mean", "entropy",
                "clip_frac", "routing_agreement_layer_0", "routing_agreement_layer_1", "ess", "mismatch_kl"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4), key
    assert got["metrics"]["num_responses"] == 16
    assert got["metrics"]["micro_batches"] >= 2  # micro-batched == unsplit
    tp = load_worker().LAYOUTS[layout][1].get("tensor", 1)
    assert got["metrics"]["logit_columns"] == read_hf_dims(sharp_model_dir).vocab_size // tp
    if tp > 1:  # chunked vocabulary-parallel log-probs == unchunked (values, entropy, grads)
        assert got["metrics"]["chunked_lp_diff"] < 1e-5, got["metrics"]
        assert got["metrics"]["chunked_entropy_diff"] < 1e-5, got["metrics"]
        assert got["metrics"]["chunked_grad_rel"] < 1e-5, got["metrics"]
    if layout in ("dp2", "dp2_ep2", "tp2_dp2_ep2"):  # optimizer state sharded over dp ranks
        assert got["metrics"]["restore_exact"] == 1.0
        # a checkpoint from before per-rank files (the state gathered to dp rank 0) resumes too
        assert got["metrics"]["legacy_restore_exact"] == 1.0


def test_r3_differs_from_r2(one_rank_results):
    """The R3 runs replay the samples' random routing: a different update (so
    the tp2_r3 comparison above does test the replay path under TP)."""
    a, b = one_rank_results["R2"]["state"], one_rank_results["R3"]["state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-4


def test_samples_exercise_the_tp_padding(sharp_model_dir):
    """One mini-batch has an odd number of input positions: under tp2 the
    forward pads it and the replay indices are padded and cut per rank."""
    from rlstream.consumer.train.batch import build_global_batch

    gb = build_global_batch(load_worker().make_samples(sharp_model_dir), 4, 2, "mean")
    lengths = [mb.tokens.shape[1] - 1 for mb in gb.minibatches]
    assert any(n % 2 for n in lengths) and any(n % 2 == 0 for n in lengths), lengths
