"""The trainer on one GPU (issues #14, #16): world size 1 with the NCCL backend
(consumer/train/parallel.py `init_parallel` picks NCCL whenever CUDA is present).

Each test mirrors a CPU integration test, on CUDA, with that test's helpers
and tolerances (imported, not copied):
  model build and HF log-prob parity (fp32, 1e-4)  tests/integration/test_megatron_model.py
  R3 and R2 replay, the routing actually replayed  tests/integration/test_routing_replay.py
  checkpoint and restore (masters, moments exact)  tests/integration/test_trainer_step.py
  a bf16 step with fp32 masters                    tests/integration/test_trainer_precision.py
  peak memory and step time at 4k and 16k tokens   tests/bench/trainer_scale.py (its mid-size model)
and the Transformer Engine attention build. Skipped, with the reason, where
CUDA, megatron-core (or TE) is absent; nothing touches CUDA at import. Run in
a session of their own, so that the process group is NCCL's:

    .venv/bin/python -m pytest -m gpu tests/gpu -s   # -s shows the memory figures
"""
from __future__ import annotations

import importlib.util
import math
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.usefixtures("needs_megatron"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

POINTS = (4096, 16384)
"""Tokens per micro-batch of the memory points (issue #16: 4k and 16k)."""


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory):
    """tests/bench/trainer_scale.py's mid-size MoE (its MID spec), built once."""
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from tests.bench.trainer_scale import MID

    return build_tiny_model(tmp_path_factory.mktemp("mid") / "m", TinyModelSpec(**MID))


def on_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


# ---------------------------------------------------------------- model: build and HF parity


@pytest.mark.parametrize("head", ["untied", "tied"])
def test_model_builds_on_cuda_from_hf_and_matches_hf_fp32(megatron_world, perturbed_dirs, head):
    """As test_megatron_model.py: the HF Qwen3-MoE directory builds a Megatron model
    on the GPU whose fp32 log-probs match HF's (HF on the host, fp32) within 1e-4,
    and whose export is the checkpoint bit for bit."""
    import torch.distributed as dist

    from rlstream.consumer.train import export, layout, replay
    from rlstream.consumer.train.model import load_hf_checkpoint, per_token_logprobs, read_hf_dims
    from tests.support.hf_reference import hf_token_logprobs

    model = load_hf_checkpoint(perturbed_dirs[head])
    assert dist.get_backend() == "nccl"
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    dims = read_hf_dims(perturbed_dirs[head])
    assert len(replay.routers(model)) == dims.num_layers
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = on_host(per_token_logprobs(model, tokens))
    theirs = hf_token_logprobs(perturbed_dirs[head], tokens)
    assert ours.shape == theirs.shape == (3, 39)
    assert (ours - theirs).abs().max().item() < 1e-4
    assert ours.std() > 0.1  # not a degenerate (uniform) distribution
    on_disk = layout.read_hf_safetensors(perturbed_dirs[head])
    exported = export.export_hf_state_dict(model)
    assert set(exported) == set(on_disk)
    assert all(torch.equal(on_host(exported[k]), v) for k, v in on_disk.items())


# ---------------------------------------------------------------- routing replay (R3, R2)


@pytest.fixture(scope="module")
def fp32_model(megatron_world, sharp_model_dir):
    from rlstream.consumer.train.model import load_hf_checkpoint

    return load_hf_checkpoint(sharp_model_dir)


def test_r3_replays_the_records_routing_on_cuda(fp32_model, bf16_rollouts):
    """As test_routing_replay.py: under R3 every router of the CUDA model dispatches
    with the record's experts (bf16 rollouts), where its own fp32 choice differs."""
    from rlstream.consumer.train import replay
    from rlstream.consumer.train.batch import build_global_batch
    from rlstream.consumer.train.model import forward_logits
    from tests.support.router_hooks import routing_used, sorted_routing

    mb = build_global_batch(bf16_rollouts, 4).minibatches[0]
    b, real = mb.tokens.shape[0], mb.input_mask
    recorded = sorted_routing(mb.routing)[real]
    with torch.no_grad(), routing_used(fp32_model) as calls, replay.replaying(fp32_model, mb.routing):
        forward_logits(fp32_model, mb.tokens[:, :-1])
    used = on_host(replay.from_layer_indices(calls, b))
    assert torch.equal(used[real], recorded)
    with torch.no_grad(), routing_used(fp32_model) as calls:
        forward_logits(fp32_model, mb.tokens[:, :-1])
    natural = on_host(replay.from_layer_indices(calls, b))
    assert not torch.equal(natural[real], recorded)  # so the replay above is what made them equal


def test_r3_replaying_own_routing_is_exact_on_cuda(fp32_model, bf16_rollouts):
    """Replaying the model's own recorded routing gives identical log-probs; the
    same routing shuffled across the batch does not (the [B, S] layout on CUDA)."""
    from rlstream.consumer.train import replay
    from rlstream.consumer.train.batch import build_global_batch
    from rlstream.consumer.train.model import per_token_logprobs

    tokens = build_global_batch(bf16_rollouts, 4).minibatches[0].tokens[:8]
    with torch.no_grad():
        with replay.recording(fp32_model) as rec:
            plain = per_token_logprobs(fp32_model, tokens)
        own = replay.from_layer_indices(rec["layers"], tokens.shape[0])
        with replay.replaying(fp32_model, own):
            replayed = per_token_logprobs(fp32_model, tokens)
        with replay.replaying(fp32_model, own.roll(1, dims=0)):
            shuffled = per_token_logprobs(fp32_model, tokens)
    # the MoE dispatch sums expert outputs with atomics on CUDA: equal up to float rounding
    assert (plain - replayed).abs().max().item() < 1e-5
    assert (plain - shuffled).abs().max().item() > 1e-3


@pytest.mark.parametrize("mode,expect_same", [("R2", True), ("none", False)])
def test_r2_replays_old_policy_routing_in_later_minibatches_on_cuda(sharp_model_dir, bf16_rollouts,
                                                                    mode, expect_same):
    """As test_routing_replay.py: with R2 the update pass of each later mini-batch
    dispatches with the old-policy pass's routing; without replay it does not."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train import replay
    from rlstream.consumer.train.trainer import Trainer
    from tests.support.router_hooks import routing_used

    n = 4
    trainer = Trainer.from_hf(sharp_model_dir, ConsumerSettings(
        replay=mode, num_minibatches=n, optimizer={"lr": 3e-2, "grad_clip": 0}))
    assert trainer.device.type == "cuda"
    gb = trainer.build_batch(bf16_rollouts, 4)
    with routing_used(trainer.model) as calls:
        trainer.train_step(gb)
    layers = len(replay.routers(trainer.model))
    assert len(calls) == 2 * n * layers  # one old-policy and one update forward per mini-batch
    per_forward = [calls[i * layers:(i + 1) * layers] for i in range(2 * n)]
    old, upd = per_forward[:n], per_forward[n:]
    for i in range(1, n):
        same = all(torch.equal(a, b) for a, b in zip(old[i], upd[i]))
        assert same == expect_same, f"mini-batch {i}"


def test_r3_lowers_training_inference_kl_on_cuda(sharp_model_dir, bf16_rollouts):
    """As test_routing_replay.py: R3 at least halves the bf16-vs-fp32 KL."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    kl = {}
    for mode in ("none", "R3"):
        trainer = Trainer.from_hf(sharp_model_dir, ConsumerSettings(replay=mode, optimizer={"lr": 1e-6}))
        kl[mode] = trainer.train_step(trainer.build_batch(bf16_rollouts, 4))["kl_train_inference"]
    assert abs(kl["R3"]) < 0.5 * kl["none"], kl


# ---------------------------------------------------------------- checkpoint and restore


def max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("dtype,distributed,offload", [("float32", True, 0.0), ("bfloat16", True, 0.0),
                                                       ("bfloat16", False, 0.0), ("bfloat16", True, 0.5)])
def test_checkpoint_round_trip_on_cuda(sharp_model_dir, bf16_rollouts, tmp_path, dtype, distributed, offload):
    """As test_trainer_step.py's round trip: saved on CUDA, loaded into a fresh
    trainer, the fp32 masters and Adam moments are bit-exact (with the optimizer offload too:
    the step after the resume ran at all is the check the CPU stand-ins cannot make); the next step of
    both agrees. Not bit-exact here: the CUDA MoE dispatch accumulates with
    atomics, so the two continued steps agree to 1 % of the update they make
    (a lost or stale moment changes Adam's second update by O(1))."""
    from rlstream.consumer.train.trainer import Trainer
    from tests.support.configs import trainer_settings
    from tests.support.state import params_of, tensors_of

    cfg = trainer_settings(lr=1e-3, num_minibatches=2, replay="R2", dtype=dtype)
    cfg.optimizer.distributed = distributed
    cfg.optimizer.cpu_offload_fraction = offload  # 0.5: Megatron's HybridDeviceOptimizer, half the state on the host
    a = Trainer.from_hf(sharp_model_dir, cfg)
    assert a.device.type == "cuda"
    gb = a.build_batch(bf16_rollouts, 4)
    a.train_step(gb)
    saved = a.state_dict()
    torch.save(saved, tmp_path / "ckpt.pt")
    b = Trainer.from_hf(sharp_model_dir, cfg)
    b.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))  # as consumer/checkpoint/files.py
    assert b.step == 1
    want, got = tensors_of(saved["optimizer"]), tensors_of(b.state_dict()["optimizer"])
    assert any(t.dtype == torch.float32 and t.numel() > 1000 for t in want.values())
    assert set(got) == set(want) and all(torch.equal(on_host(got[k]), on_host(want[k])) for k in want)
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)  # the restored weights themselves: exact
    start = {p: m.clone() for p, m in a.optimizer.fp32_masters().items()}
    ma, mb = a.train_step(gb), b.train_step(gb)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    ends = [list(t.optimizer.fp32_masters().values()) for t in (a, b)]
    moved = max(float((e - s).abs().max()) for e, s in zip(ends[0], start.values()))
    apart = max(float((x - y).abs().max()) for x, y in zip(*ends))
    assert moved > 0 and apart <= 1e-2 * moved, (apart, moved)


# ---------------------------------------------------------------- a bf16 step, TE attention


def test_bf16_step_on_cuda_with_nccl(tiny_model_dir):
    import torch.distributed as dist

    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train import megatron_shims
    from rlstream.consumer.train.trainer import Trainer
    from tests.integration.multirank_worker import make_samples

    trainer = Trainer.from_hf(tiny_model_dir, ConsumerSettings(
        dtype="bfloat16", replay="R3", num_minibatches=2, optimizer={"lr": 1e-6},
        memory={"micro_batch_tokens": 24, "recompute": True}))
    assert dist.get_backend() == "nccl" and trainer.device.type == "cuda"
    assert not set(megatron_shims.CPU_SHIMS) & megatron_shims.apply()
    before = {p: m.clone() for p, m in trainer.optimizer.fp32_masters().items()}
    metrics = trainer.train_step(trainer.build_batch(make_samples(str(tiny_model_dir)), 4))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    moved = [not torch.equal(before[p], m) for p, m in trainer.optimizer.fp32_masters().items()]
    assert sum(moved) > 0.9 * len(moved)  # lr 1e-6 moves the fp32 masters


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="Transformer Engine is not installed (not in the gpu extra)")
def test_te_attention_builds_and_matches_sdpa(tiny_model_dir):
    from rlstream.consumer.train.model import load_hf_checkpoint, per_token_logprobs

    te = load_hf_checkpoint(tiny_model_dir, dtype=torch.bfloat16, attention="te")
    sdpa = load_hf_checkpoint(tiny_model_dir, dtype=torch.bfloat16, attention="sdpa")
    tokens = torch.randint(3, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = per_token_logprobs(te, tokens), per_token_logprobs(sdpa, tokens)
    assert float((a - b).abs().max()) < 5e-2  # bf16 kernels differ in rounding only


def memory_point(model_dir, tokens: int) -> dict:
    """One train_step on one sequence of `tokens` positions, as the bench's
    `measure_point` (its scaled settings): CUDA peak above idle and seconds."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer
    from tests.bench.trainer_scale import SCALED, one_sample

    trainer = Trainer.from_hf(model_dir, ConsumerSettings(
        group_size=1, dtype="bfloat16", optimizer={"lr": 1e-6},
        memory={**SCALED, "micro_batch_tokens": tokens}))
    vocab = trainer.model.hf_dims.vocab_size
    trainer.train_step(trainer.build_batch([one_sample(64, vocab, 1)], 1))  # optimizer state, kernels
    gb = trainer.build_batch([one_sample(tokens, vocab)], 1)
    torch.cuda.synchronize()
    idle = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = trainer.train_step(gb)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    peak = torch.cuda.max_memory_allocated() - idle
    del trainer, gb
    torch.cuda.empty_cache()
    return {"tokens": tokens, "peak_above_idle_mb": peak / 2**20, "step_seconds": seconds,
            "idle_mb": idle / 2**20}


def test_peak_memory_and_step_time_at_4k_and_16k_tokens(mid_model_dir):
    """Peak CUDA memory (torch.cuda.max_memory_allocated above the idle trainer)
    grows at most linearly with the tokens of a micro-batch (exponent <= 1.2, the
    bench's goal). Prints the figures for docs/gpu.md."""
    import json

    from tests.bench.trainer_scale import MID, slope

    rows = [memory_point(mid_model_dir, t) for t in POINTS]
    exponent = slope(rows)
    print("\n" + json.dumps({"bench": "gpu_trainer_memory", "model": MID, "dtype": "bfloat16",
                             "device": torch.cuda.get_device_name(0), "memory_growth_exponent": exponent,
                             "points": [{k: round(v, 3) for k, v in r.items()} for r in rows]}))
    assert all(r["peak_above_idle_mb"] > 1.0 for r in rows), rows  # a step that allocated nothing measured nothing
    assert exponent <= 1.2, rows
