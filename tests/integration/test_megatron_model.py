"""The Megatron model against HF transformers: same per-token log-probabilities
(fp32, 1e-4) and a bit-exact HF -> Megatron -> HF round trip, tied and untied."""
from __future__ import annotations

import pytest
import torch

from rlstream.common.errors import ConfigError, RlstreamError
from rlstream.consumer.train import export, layout, megatron_shims
from rlstream.consumer.train.model import load_hf_checkpoint, per_token_logprobs, read_hf_dims
from tests.support.hf_reference import hf_token_logprobs

pytestmark = pytest.mark.megatron
HEADS = ["untied", "tied"]


@pytest.fixture(scope="module")
def models(megatron_world, perturbed_dirs):
    return {h: load_hf_checkpoint(perturbed_dirs[h]) for h in HEADS}


@pytest.mark.parametrize("head", HEADS)
def test_logprobs_match_hf_fp32(models, perturbed_dirs, head):
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = per_token_logprobs(models[head], tokens)
    theirs = hf_token_logprobs(perturbed_dirs[head], tokens)
    assert ours.shape == theirs.shape == (3, 39)
    assert (ours - theirs).abs().max().item() < 1e-4
    assert ours.std() > 0.1  # not a degenerate (uniform) distribution


@pytest.mark.parametrize("head", HEADS)
def test_round_trip_bit_exact(models, perturbed_dirs, head):
    on_disk = layout.read_hf_safetensors(perturbed_dirs[head])
    dims = read_hf_dims(perturbed_dirs[head])
    assert ("lm_head.weight" in on_disk) == (head == "untied")
    pure = layout.megatron_to_hf(layout.hf_to_megatron(on_disk, dims), dims)
    exported = export.export_hf_state_dict(models[head])
    for got in (pure, exported):
        assert set(got) == set(on_disk)
        for k, v in on_disk.items():
            assert got[k].dtype == v.dtype and got[k].is_contiguous(), k
            assert torch.equal(got[k], v), k


def test_export_is_safetensors_ready(models, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = export.export_hf_state_dict(models["untied"])
    save_file(sd, str(tmp_path / "model.safetensors"))
    back = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_shard_unshard_is_identity(perturbed_dirs, tp, ep):
    dims = read_hf_dims(perturbed_dirs["untied"])
    full = layout.hf_to_megatron(layout.read_hf_safetensors(perturbed_dirs["untied"]), dims)
    shards = {(t, e): layout.shard_megatron(full, dims, t, tp, e, ep)
              for t in range(tp) for e in range(ep)}
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[(0, 0)][qkv].shape[0] == full[qkv].shape[0] // tp
    n_local = sum(1 for k in shards[(0, 0)] if k.startswith("decoder.layers.0.")
                  and k.endswith("linear_fc2.weight"))
    assert n_local == dims.num_experts // ep
    back = layout.unshard_megatron(shards, dims, tp, ep)
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)


def test_qkv_fusion_layout(perturbed_dirs):
    """Megatron's fused layout: per kv group, its q heads then k then v."""
    dims = read_hf_dims(perturbed_dirs["untied"])
    hf = layout.read_hf_safetensors(perturbed_dirs["untied"])
    qkv = layout.hf_to_megatron(hf, dims)["decoder.layers.1.self_attention.linear_qkv.weight"]
    hd, per = dims.head_dim, dims.num_heads // dims.num_kv_heads
    a = "model.layers.1.self_attn."
    g1 = qkv[(per + 2) * hd:2 * (per + 2) * hd]
    assert torch.equal(g1[:per * hd], hf[a + "q_proj.weight"][per * hd:2 * per * hd])
    assert torch.equal(g1[per * hd:(per + 1) * hd], hf[a + "k_proj.weight"][hd:2 * hd])
    assert torch.equal(g1[(per + 1) * hd:], hf[a + "v_proj.weight"][hd:2 * hd])


def test_mismatched_checkpoint_is_reported(perturbed_dirs):
    dims = read_hf_dims(perturbed_dirs["untied"])
    hf = layout.read_hf_safetensors(perturbed_dirs["untied"])
    del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(RlstreamError, match="up_proj"):
        layout.hf_to_megatron(hf, dims)
    with pytest.raises(ConfigError, match="config.json"):
        read_hf_dims(perturbed_dirs["untied"] / "nope")


def test_shims_idempotent_on_cpu(megatron_world):
    everything = frozenset(megatron_shims.TE_SHIMS + megatron_shims.NORM_SHIMS
                           + megatron_shims.CPU_SHIMS)
    assert megatron_shims.apply() == everything and megatron_shims.apply() == everything
    assert torch.cuda.current_device() == "cpu"
    mask = megatron_shims.causal_attention_mask(3)
    assert mask.shape == (1, 1, 3, 3) and mask[0, 0].tolist() == [
        [False, True, True], [False, False, True], [False, False, False]]


def test_gpu_without_transformer_engine_gets_only_the_te_shim(monkeypatch, megatron_world):
    """B2: each shim on the condition it repairs. A CUDA node without Transformer
    Engine still lacks `te_general_gemm` (NameError at the first MoE forward), and
    must keep its real current_device, RNG tracker and optimizer calls."""
    from megatron.core.tensor_parallel import random as mpu_random
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_shims, "_applied", set())  # as in a fresh process
    monkeypatch.delattr(moe_utils, "te_general_gemm")       # TE absent, as megatron-core leaves it
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)  # no Apex/TE kernels
    device, fork, rng = object(), object(), object()
    monkeypatch.setattr(torch.cuda, "current_device", device)
    monkeypatch.setattr(mpu_random.CudaRNGStatesTracker, "fork", fork)
    monkeypatch.setattr(mpu_random, "_get_cuda_rng_state", rng)
    assert megatron_shims.apply() == {"te_general_gemm", "l2_norm"}  # no Apex either
    assert moe_utils.te_general_gemm is None
    assert torch.cuda.current_device is device and mpu_random._get_cuda_rng_state is rng
    assert mpu_random.CudaRNGStatesTracker.fork is fork
    assert not isinstance(megatron_shims.cuda_as_cpu(), megatron_shims.CudaAsCpu)
    opt = type("Opt", (), {"step": lambda self: "real"})()
    assert megatron_shims.wrap_optimizer(opt) is opt and "step" not in vars(opt)  # not wrapped


# ---------------------------------------------------------------- grouped-GEMM experts


@pytest.fixture(scope="module")
def expert_kinds(megatron_world, sharp_model_dir):
    """The same checkpoint in SequentialMLP and in the grouped layout (consumer/train/experts.py)."""
    return {k: load_hf_checkpoint(sharp_model_dir, experts=k) for k in ("sequential", "grouped")}


def test_grouped_experts_equal_sequential_fp32(expert_kinds):
    """One grouped GEMM over the experts = one GEMM per expert: log-probs and every
    parameter's gradient within fp32 tolerance, same tokens, same weights."""
    from rlstream.consumer.train.experts import sequential_names

    seq, grp = expert_kinds["sequential"], expert_kinds["grouped"]
    assert (seq.experts, grp.experts) == ("sequential", "torch_grouped")
    assert type(grp.decoder.layers[0].mlp.experts).__name__ == "TorchGroupedMLP"
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(7))
    grads = {}
    for kind, model in expert_kinds.items():
        model.zero_grad()
        lp, ent = per_token_logprobs(model, tokens, with_entropy=True)
        (lp.mean() + 0.1 * ent.mean()).backward()
        grads[kind] = (lp.detach(), sequential_names(
            {n: p.grad for n, p in model.named_parameters()}, model))
    (lp_s, g_s), (lp_g, g_g) = grads["sequential"], grads["grouped"]
    assert (lp_s - lp_g).abs().max().item() < 1e-5 and lp_s.std() > 0.1
    assert set(g_s) == set(g_g)
    expert = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    assert g_s[expert].abs().max() > 0  # the experts get gradient: the comparison means something
    worst = max(((g - g_g[n]).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                for n, g in g_s.items())
    assert worst < 1e-5, worst  # relative to each gradient's largest entry


def test_grouped_experts_export_and_checkpoint_names(expert_kinds, sharp_model_dir):
    """The grouped weights export to the same HF tensors (bit-exact to the file), and
    the checkpoint names are SequentialMLP's: a sequential model's state loads into a
    grouped one through the views."""
    seq, grp = expert_kinds["sequential"], expert_kinds["grouped"]
    on_disk = layout.read_hf_safetensors(sharp_model_dir)
    exported = export.export_hf_state_dict(grp)
    assert set(exported) == set(on_disk)
    assert all(torch.equal(exported[k], v) for k, v in on_disk.items())
    state_s, state_g = layout.local_megatron_state_dict(seq), layout.local_megatron_state_dict(grp)
    assert set(state_s) == set(state_g)
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    before = grp.decoder.layers[0].mlp.experts.weight2.detach().clone()
    with torch.no_grad():
        state_g[name].copy_(state_s[name] * 2)  # writes into the grouped weight2
        assert not torch.equal(grp.decoder.layers[0].mlp.experts.weight2, before)
        assert torch.equal(export.export_hf_state_dict(grp)["model.layers.0.mlp.experts.3.down_proj.weight"],
                           on_disk["model.layers.0.mlp.experts.3.down_proj.weight"] * 2)
        state_g[name].copy_(state_s[name])


def test_grouped_experts_without_rows_and_with_a_broadcast_gradient(expert_kinds):
    """A rank whose experts receive no token still gives every expert weight a (zero)
    gradient, and a broadcast output gradient (`out.sum()`) passes torch._grouped_mm's
    backward, which refuses stride-0 gradients."""
    experts = expert_kinds["grouped"].decoder.layers[0].mlp.experts
    n, h = experts.num_local_experts, experts.config.hidden_size
    for rows, counts in ((0, [0] * n), (5, [2, 0, 3] + [0] * (n - 3))):
        experts.zero_grad()
        hidden = torch.randn(rows, h, requires_grad=True)
        out, _ = experts(hidden, torch.tensor(counts), torch.rand(rows))
        out.sum().backward()
        assert out.shape == (rows, h)
        assert experts.weight1.grad is not None and experts.weight2.grad is not None
        assert (experts.weight1.grad.abs().sum() > 0) == (rows > 0)
