"""One training step on the tiny model: metrics against direct computations,
the update itself, clipping, every loss, checkpoint round trip, export."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlstream.consumer.train import layout
from rlstream.consumer.train.batch import build_global_batch
from rlstream.consumer.train.losses import LOSSES, advantage_mode
from rlstream.consumer.train.model import per_token_logprobs
from rlstream.consumer.train.trainer import Trainer
from tests.support.configs import trainer_settings
from tests.support.state import params_of, tensors_of

pytestmark = pytest.mark.megatron


def test_metrics_match_direct_computation(sharp_model_dir, bf16_rollouts):
    trainer = Trainer.from_hf(sharp_model_dir, trainer_settings(lr=1e-4))
    gb = trainer.build_batch(bf16_rollouts, 4)
    mb = gb.minibatches[0]
    with torch.no_grad():
        lp, ent = per_token_logprobs(trainer.model, mb.tokens, with_entropy=True)
    m = mb.loss_mask
    mu = mb.rollout_logprobs
    metrics = trainer.train_step(gb)
    # N = 1: pi == pi_old at the update, so r = 1, nothing masked, w = pi_old / mu_old
    assert metrics["kl_train_inference"] == pytest.approx(float((mu - lp)[m].mean()), rel=1e-5)
    assert metrics["entropy"] == pytest.approx(float(ent[m].mean()), rel=1e-5)
    w = torch.exp(lp - mu)[m]
    assert metrics["is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert metrics["is_weight_max"] == pytest.approx(float(w.max()), rel=1e-5)
    assert metrics["is_truncated_frac"] == pytest.approx(float((w > 5).float().mean()))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_frac"] == 0.0
    # the stability signals (every sample at staleness 0: the KL is the mismatch, one bucket)
    assert metrics["ess"] == pytest.approx(float(w.sum() ** 2 / (len(w) * (w * w).sum())), rel=1e-5)
    assert metrics["mismatch_kl"] == pytest.approx(metrics["kl_train_inference"], rel=1e-6)
    assert set(metrics["by_staleness"]) == {"0"} and metrics["by_staleness"]["0"]["token_share"] == 1.0
    adv = mb.advantages.unsqueeze(-1)
    want_loss = -float((w.new_zeros(m.shape).masked_scatter(m, w.clamp(max=5)) * adv * lp
                        * m).sum()) / gb.num_responses
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["num_responses"] == 32 and metrics["num_tokens"] == int(m.sum())
    for layer in (0, 1):
        assert 0.5 < metrics[f"routing_agreement_layer_{layer}"] <= 1.0
    assert metrics["grad_norm"] > 0 and 0 <= metrics["step_overhead_share"] < 1


def test_every_rank_reduces_the_same_metric_sums_with_or_without_routing(sharp_model_dir, bf16_rollouts,
                                                                        monkeypatch):
    """The metric sums are all-reduced over data-parallel ranks as one flat tensor: a rank whose
    share has no routing (a producer with routing off) must add the same keys as one whose share
    has it. It added fewer, and gloo aborted a 2-rank trainer on the cluster twin ("32 vs 24")."""
    import dataclasses

    import rlstream.consumer.train.trainer as trainer_mod

    sizes: list[int] = []

    def reduce(t, op):
        sizes.append(t.numel())
        return t
    monkeypatch.setattr(trainer_mod, "reduce_over_data_parallel", reduce)
    trainer = Trainer.from_hf(sharp_model_dir, trainer_settings(lr=1e-4))
    trainer.train_step(trainer.build_batch(bf16_rollouts, 4))
    routed = list(sizes)
    sizes.clear()
    unrouted = [dataclasses.replace(r, routed_experts=None) for r in bf16_rollouts]
    metrics = trainer.train_step(trainer.build_batch(unrouted, 4))
    assert sizes == routed and "routing_agreement_layer_0" not in metrics


def test_step_updates_weights_and_later_minibatches_see_staleness(sharp_model_dir, bf16_rollouts):
    trainer = Trainer.from_hf(sharp_model_dir, trainer_settings(lr=3e-3, num_minibatches=4))
    before = params_of(trainer)
    metrics = trainer.train_step(trainer.build_batch(bf16_rollouts, 4))
    after = params_of(trainer)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert "decoder.layers.1.mlp.router.weight" in changed
    assert "embedding.word_embeddings.weight" in changed
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # pi moved from pi_old
    assert trainer.step == 1 and all_finite(metrics), metrics


def all_finite(metrics: dict) -> bool:
    """Every number of a step's metrics is finite: the scalars and the signals by staleness
    (a dict of buckets); a KL with no tokens to measure it on is None (consumer/stability/signals.py)."""
    values = [v for k, v in metrics.items() if k != "by_staleness"]
    values += [v for bucket in metrics.get("by_staleness", {}).values() for v in bucket.values()]
    return all(math.isfinite(v) for v in values if v is not None)


def test_grad_clipping_bounds_the_update(sharp_model_dir, bf16_rollouts):
    cfg = trainer_settings(optimizer="sgd", lr=1.0, grad_clip=1e-3)
    trainer = Trainer.from_hf(sharp_model_dir, cfg)
    before = params_of(trainer)
    metrics = trainer.train_step(trainer.build_batch(bf16_rollouts, 4))
    after = params_of(trainer)
    step = math.sqrt(sum(float((after[n] - before[n]).pow(2).sum()) for n in before))
    assert metrics["grad_norm"] > 1e-2  # the raw gradient was much larger than the cap
    assert step == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_trains(sharp_model_dir, bf16_rollouts, loss):
    trainer = Trainer.from_hf(sharp_model_dir, trainer_settings(loss=loss, num_minibatches=2, lr=1e-3))
    first = trainer.train_step(trainer.build_batch(bf16_rollouts, 4))
    assert all_finite(first), first
    assert first["grad_norm"] > 0


def test_grpo_uses_std_normalised_advantages(bf16_rollouts):
    mean = build_global_batch(bf16_rollouts, 4, advantage_mode="mean").minibatches[0].advantages
    std = build_global_batch(bf16_rollouts, 4, advantage_mode="mean_std").minibatches[0]
    rewards = np.array([s.reward for s in bf16_rollouts], dtype=np.float64).reshape(-1, 4)
    want = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True)
                                                         + 1e-6)
    np.testing.assert_allclose(std.advantages.numpy(), want.ravel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean.numpy(), (rewards - rewards.mean(1, keepdims=True)).ravel(),
                               atol=1e-6)
    assert advantage_mode(trainer_settings(loss="grpo").loss) == "mean_std"
    assert advantage_mode(trainer_settings(loss="minirl").loss) == "mean"


@pytest.mark.parametrize("dtype,distributed", [("float32", True), ("bfloat16", True),
                                               ("bfloat16", False)])
def test_checkpoint_round_trip_continues_identically(sharp_model_dir, bf16_rollouts, tmp_path,
                                                     dtype, distributed):
    cfg = trainer_settings(lr=1e-3, num_minibatches=2, replay="R2", dtype=dtype)
    cfg.optimizer.distributed = distributed
    a = Trainer.from_hf(sharp_model_dir, cfg)
    gb = a.build_batch(bf16_rollouts, 4)
    a.train_step(gb)
    saved = a.state_dict()
    torch.save(saved, tmp_path / "ckpt.pt")
    b = Trainer.from_hf(sharp_model_dir, cfg)
    b.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))  # as consumer/checkpoint/files.py
    assert b.step == 1
    # fp32 masters and Adam moments survive bit-exactly (the distributed optimizer's
    # own state_dict() holds none of them: consumer/train/optimizer.py adds this rank's shard)
    want, got = tensors_of(saved["optimizer"]), tensors_of(b.state_dict()["optimizer"])
    assert any(t.dtype == torch.float32 and t.numel() > 1000 for t in want.values())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    ma, mb = a.train_step(gb), b.train_step(gb)
    assert ma["loss"] == mb["loss"]
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def trained_distributed(model_dir, rollouts, dtype: str = "bfloat16"):
    cfg = trainer_settings(lr=1e-3, dtype=dtype)
    cfg.optimizer.distributed = True
    t = Trainer.from_hf(model_dir, cfg)
    t.train_step(t.build_batch(rollouts, 4))
    return t, cfg


def test_a_checkpoint_is_each_ranks_own_files_taken_without_a_collective(sharp_model_dir, bf16_rollouts,
                                                                         tmp_path):
    """N7b: the snapshot copies this rank's own optimizer shard (no gather to data-parallel
    rank 0: no collective at all) and the model into the pair's file and the rank's own;
    a fresh trainer resumed from those files holds the same state."""
    from rlstream.consumer.checkpoint.files import CheckpointManager, CheckpointState
    from rlstream.consumer.checkpoint.writer import checkpoint_shard
    from rlstream.consumer.ranks.protocol import Leader
    from tests.support.collectives import recorded

    a, cfg = trained_distributed(sharp_model_dir, bf16_rollouts)
    ckpt = CheckpointManager(tmp_path / "ckpt")
    leader = Leader(a, ckpt, 4)
    with recorded() as calls:
        leader.checkpoint(CheckpointState(1, 1, {0: 0}))
    leader.stop()
    assert calls == [], [c.name for c in calls]
    st, path = ckpt.latest()
    plan = checkpoint_shard()
    assert sorted(p.name for p in path.glob("*.pt")) == sorted(plan.every) == ["optim-rank00000-of00001.pt",
                                                                                "trainer.pt"]
    b = Trainer.from_hf(sharp_model_dir, cfg)
    b.load_state_dict(ckpt.load_trainer_state(path, plan.pair, plan.own))
    want, got = tensors_of(a.state_dict()), tensors_of(b.state_dict())
    assert any(k.startswith("/optimizer") and t.numel() > 1000 for k, t in want.items())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_from_before_per_rank_files_still_resumes(sharp_model_dir, bf16_rollouts, tmp_path):
    """The gathered form (optimizer state in the pair's file, "dp_zero_gather_scatter", as
    consumer/train/optimizer.py wrote it up to the per-rank files) loads and trains on identically."""
    from rlstream.consumer.checkpoint.files import (
        TRAINER,
        CheckpointManager,
        CheckpointState,
        rank_shard_name,
    )

    a, cfg = trained_distributed(sharp_model_dir, bf16_rollouts, dtype="float32")
    old = a.state_dict()
    for opt, part in zip(a.optimizer.parts, old["optimizer"]["parts"]):
        if "param_state" in part:  # what the old state_dict() put there
            part["param_state"] = opt.get_parameter_state_dp_zero()
            part["param_state_sharding_type"] = "dp_zero_gather_scatter"
    ckpt = CheckpointManager(tmp_path / "ckpt")
    path = ckpt.save(CheckpointState(1, 1, {0: 0}), old)  # trainer.pt only, as before
    b = Trainer.from_hf(sharp_model_dir, cfg)
    b.load_state_dict(ckpt.load_trainer_state(path, TRAINER, rank_shard_name(0, 1)))
    want, got = tensors_of(a.state_dict()), tensors_of(b.state_dict())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    gb = a.build_batch(bf16_rollouts, 4)
    assert a.train_step(gb)["loss"] == b.train_step(gb)["loss"]
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_export_after_step_is_the_trained_model(sharp_model_dir, bf16_rollouts, tmp_path):
    """Export -> save -> reload gives a model with the trained log-probabilities."""
    from safetensors.torch import save_file

    from rlstream.consumer.train.model import load_hf_checkpoint

    trainer = Trainer.from_hf(sharp_model_dir, trainer_settings(lr=1e-2))
    gb = trainer.build_batch(bf16_rollouts, 4)
    trainer.train_step(gb)
    original = layout.read_hf_safetensors(sharp_model_dir)
    exported = trainer.export_hf_state_dict()
    assert set(exported) == set(original)
    assert not torch.equal(exported["model.layers.0.mlp.gate.weight"],
                           original["model.layers.0.mlp.gate.weight"])
    out = tmp_path / "v1"
    out.mkdir()
    (out / "config.json").write_text((sharp_model_dir / "config.json").read_text())
    save_file(exported, str(out / "model.safetensors"))
    reloaded = load_hf_checkpoint(out)
    tokens = gb.minibatches[0].tokens
    with torch.no_grad():
        assert torch.equal(per_token_logprobs(reloaded, tokens),
                           per_token_logprobs(trainer.model, tokens))
