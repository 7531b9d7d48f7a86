"""HF Qwen3-MoE safetensors naming <-> Megatron-core GPTModel state dict.

Pure functions over dicts of tensors; both directions are exact copies (no
arithmetic), so HF -> Megatron -> HF reproduces every tensor bit for bit.

    HF (on-disk, what vLLM loads)                 Megatron (local spec)
    model.embed_tokens.weight                     embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight         decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.weight  decoder.layers.i.self_attention.linear_qkv.weight
    model.layers.i.self_attn.o_proj.weight        decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.self_attn.{q,k}_norm.weight    decoder.layers.i.self_attention.{q,k}_layernorm.weight
    model.layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.gate.weight                decoder.layers.i.mlp.router.weight
    model.layers.i.mlp.experts.j.{gate,up}_proj   decoder.layers.i.mlp.experts.local_experts.j.linear_fc1
    model.layers.i.mlp.experts.j.down_proj        decoder.layers.i.mlp.experts.local_experts.j.linear_fc2
    model.norm.weight                             decoder.final_layernorm.weight
    lm_head.weight (absent when tied)             output_layer.weight (absent when tied)

Fused QKV is grouped per key/value head: [q heads of group g, k_g, v_g] for
g = 0..num_kv_heads-1 (Megatron's layout). Gated FC1 is cat([gate, up]).

Tensor/expert parallelism: `shard_megatron` cuts a full Megatron dict into one
rank's shard (column-parallel dims split per query group / per gate-up half;
experts split across expert-parallel ranks and renumbered locally), and
`unshard_megatron` is its inverse. consumer/train/export.py gathers the shards
to rank 0 one layer group at a time with these rules (`export_hf_state_dict`).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from rlstream.common.errors import ConfigError, ModelError, ParallelLayoutError
from rlstream.consumer.train.experts import sequential_names

MG_LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."
# one-to-one renames inside a layer (HF suffix, Megatron suffix)
_LAYER_RENAMES = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.gate.weight", "mlp.router.weight"),
]
_EXPERT = "mlp.experts.local_experts.{j}."


# ---------------------------------------------------------------- files


def read_hf_safetensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (single file or sharded with an index)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (d / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"no model.safetensors in {d}", "model.path")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(d / f)))
    return out


# ---------------------------------------------------------------- HF <-> Megatron (full)


def _fuse_qkv(q, k, v, dims) -> torch.Tensor:
    ng, hd = dims.num_kv_heads, dims.head_dim
    qg = q.reshape(ng, (dims.num_heads // ng) * hd, -1)
    return torch.cat([qg, k.reshape(ng, hd, -1), v.reshape(ng, hd, -1)], 1).reshape(
        -1, q.shape[-1])


def _split_qkv(qkv, dims):
    ng, hd = dims.num_kv_heads, dims.head_dim
    qper = (dims.num_heads // ng) * hd
    g = qkv.reshape(ng, qper + 2 * hd, -1)
    q, k, v = torch.split(g, [qper, hd, hd], dim=1)
    h = qkv.shape[-1]
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def hf_to_megatron(hf: dict[str, torch.Tensor], dims) -> dict[str, torch.Tensor]:
    """On-disk HF names -> full (unsharded) Megatron state dict.

    A tied checkpoint that still carries `lm_head.weight` has it ignored.
    """
    if dims.tie_word_embeddings:
        hf = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    _check_keys(hf, hf_keys(dims), "HF checkpoint")
    mg = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
          "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not dims.tie_word_embeddings:
        mg["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(dims.num_layers):
        h, m = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
        for hs, ms in _LAYER_RENAMES:
            mg[m + ms] = hf[h + hs]
        a = h + "self_attn."
        mg[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], dims)
        for j in range(dims.num_experts):
            e, me = f"{h}mlp.experts.{j}.", m + _EXPERT.format(j=j)
            mg[me + "linear_fc1.weight"] = torch.cat(
                [hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]], 0)
            mg[me + "linear_fc2.weight"] = hf[e + "down_proj.weight"]
    return mg


def megatron_to_hf(mg: dict[str, torch.Tensor], dims) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> on-disk HF names (contiguous, detached, CPU)."""
    hf: dict[str, torch.Tensor] = {}
    for g in range(num_groups(dims)):
        hf.update(megatron_group_to_hf(mg, g, dims))
    return {k: v.detach().cpu().contiguous() for k, v in hf.items()}


# ---------------------------------------------------------------- layer groups
# The unit of the weight transfer (consumer/train/export.py): group 0 is the
# embedding, group i + 1 decoder layer i, the last the final norm and lm_head;
# in HF names this is exactly vLLM's `layerwise_groups` partition.


def num_groups(dims) -> int:
    return dims.num_layers + 2


def hf_groups(dims) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(HF name, shape) of every tensor, per group, in the order `megatron_group_to_hf` yields them."""
    h, hd, nh, kv = dims.hidden_size, dims.head_dim, dims.num_heads, dims.num_kv_heads
    shapes = {"input_layernorm.weight": (h,), "self_attn.o_proj.weight": (h, nh * hd),
              "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
              "post_attention_layernorm.weight": (h,), "mlp.gate.weight": (dims.num_experts, h)}
    groups = [[("model.embed_tokens.weight", (dims.vocab_size, h))]]
    for i in range(dims.num_layers):
        p = HF_LAYER.format(i=i)
        layer = [(p + hs, shapes[hs]) for hs, _ in _LAYER_RENAMES]
        layer += [(f"{p}self_attn.{x}_proj.weight", (n * hd, h)) for x, n in (("q", nh), ("k", kv), ("v", kv))]
        for j in range(dims.num_experts):
            e = f"{p}mlp.experts.{j}."
            ffn = dims.moe_ffn_hidden_size
            layer += [(e + "gate_proj.weight", (ffn, h)), (e + "up_proj.weight", (ffn, h)),
                      (e + "down_proj.weight", (h, ffn))]
        groups.append(layer)
    post = [("model.norm.weight", (h,))]
    if not dims.tie_word_embeddings:
        post.append(("lm_head.weight", (dims.vocab_size, h)))
    return groups + [post]


def megatron_group_of(name: str, dims) -> int:
    """The group a (local) Megatron tensor name belongs to."""
    if name.startswith("embedding."):
        return 0
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return dims.num_layers + 1
    m = re.match(r"decoder\.layers\.(\d+)\.", name)
    if m is None:
        raise ModelError(f"Megatron tensor {name!r} belongs to no layer group")
    return int(m.group(1)) + 1


def megatron_group_to_hf(mg: dict[str, torch.Tensor], g: int, dims) -> dict[str, torch.Tensor]:
    """Group `g` of a full Megatron dict (it may hold that group only) -> HF names,
    in `hf_groups` order. Views where the layouts agree (no copy)."""
    if g == 0:
        return {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"]}
    if g == dims.num_layers + 1:
        hf = {"model.norm.weight": mg["decoder.final_layernorm.weight"]}
        if not dims.tie_word_embeddings:
            hf["lm_head.weight"] = mg["output_layer.weight"]
        return hf
    i = g - 1
    h, m = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
    hf = {h + hs: mg[m + ms] for hs, ms in _LAYER_RENAMES}
    q, k, v = _split_qkv(mg[m + "self_attention.linear_qkv.weight"], dims)
    a = h + "self_attn."
    hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"] = q, k, v
    for j in range(dims.num_experts):
        e, me = f"{h}mlp.experts.{j}.", m + _EXPERT.format(j=j)
        gate, up = torch.chunk(mg[me + "linear_fc1.weight"], 2, 0)
        hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"] = gate, up
        hf[e + "down_proj.weight"] = mg[me + "linear_fc2.weight"]
    return hf


def hf_keys(dims) -> set[str]:
    """Every tensor name an on-disk Qwen3-MoE checkpoint with `dims` holds."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not dims.tie_word_embeddings:
        keys.add("lm_head.weight")
    for i in range(dims.num_layers):
        h = HF_LAYER.format(i=i)
        keys |= {h + hs for hs, _ in _LAYER_RENAMES}
        keys |= {f"{h}self_attn.{p}_proj.weight" for p in "qkv"}
        keys |= {f"{h}mlp.experts.{j}.{p}_proj.weight"
                 for j in range(dims.num_experts) for p in ("gate", "up", "down")}
    return keys


def _check_keys(sd, expected: set[str], what: str) -> None:
    missing = expected - set(sd)
    extra = set(sd) - expected
    if missing or extra:
        raise ModelError(f"{what} does not match the config: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}; "
                         "check config.json against the weights")


# ---------------------------------------------------------------- TP / EP shards

EXPERT_RE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
# (suffix, dim, kind): how each weight is split across tensor-parallel ranks
_TP_RULES = [("linear_qkv.weight", 0, "qkv"), ("linear_proj.weight", 1, "plain"),
             ("linear_fc1.weight", 0, "gated"), ("linear_fc2.weight", 1, "plain"),
             ("word_embeddings.weight", 0, "plain"), ("output_layer.weight", 0, "plain")]


def tp_rule(name: str):
    for suffix, dim, kind in _TP_RULES:
        if name.endswith(suffix):
            return dim, kind
    return None


def _tp_split(t: torch.Tensor, dim: int, kind: str, size: int, dims) -> list[torch.Tensor]:
    if kind == "qkv":
        g = t.reshape(dims.num_kv_heads, -1, t.shape[-1])
        return [c.reshape(-1, t.shape[-1]) for c in torch.chunk(g, size, 0)]
    if kind == "gated":
        gate, up = torch.chunk(t, 2, 0)
        return [torch.cat(p, 0) for p in zip(torch.chunk(gate, size, 0),
                                             torch.chunk(up, size, 0))]
    return list(torch.chunk(t, size, dim))


def tp_join(parts: list[torch.Tensor], dim: int, kind: str, dims) -> torch.Tensor:
    if kind == "qkv":
        ng = dims.num_kv_heads // len(parts)
        return torch.cat([p.reshape(ng, -1, p.shape[-1]) for p in parts], 0).reshape(
            -1, parts[0].shape[-1])
    if kind == "gated":
        halves = [torch.chunk(p, 2, 0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim)


def check_shardable(dims, tp: int, ep: int) -> None:
    for what, n, by, key in [
            ("num_key_value_heads", dims.num_kv_heads, tp, "consumer.parallel.tensor"),
            ("moe_intermediate_size", dims.moe_ffn_hidden_size, tp, "consumer.parallel.tensor"),
            ("vocab_size", dims.vocab_size, tp, "consumer.parallel.tensor"),
            ("num_experts", dims.num_experts, ep, "consumer.parallel.expert")]:
        if n % by:
            raise ParallelLayoutError(f"the model's {what}={n} is not divisible by {by}", key)


def shard_megatron(full: dict, dims, tp_rank: int = 0, tp_size: int = 1,
                   ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One rank's shard of a full Megatron dict (experts renumbered locally)."""
    check_shardable(dims, tp_size, ep_size)
    per_rank = dims.num_experts // ep_size
    out = {}
    for name, t in full.items():
        m = EXPERT_RE.match(name)
        if m:
            j = int(m.group(2)) - ep_rank * per_rank
            if not 0 <= j < per_rank:
                continue
            name = f"{m.group(1)}{j}{m.group(3)}"
        rule = tp_rule(name)
        if rule and tp_size > 1:
            t = _tp_split(t, rule[0], rule[1], tp_size, dims)[tp_rank]
        out[name] = t
    return out


def unshard_megatron(shards: dict[tuple[int, int], dict], dims, tp_size: int = 1,
                     ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Inverse of `shard_megatron`: {(tp_rank, ep_rank): shard} -> full dict."""
    per_rank = dims.num_experts // ep_size
    full: dict[str, torch.Tensor] = {}
    for ep_rank in range(ep_size):
        for name in shards[(0, ep_rank)]:
            m = EXPERT_RE.match(name)
            if not m and ep_rank > 0:
                continue
            parts = [shards[(r, ep_rank)][name] for r in range(tp_size)]
            rule = tp_rule(name)
            t = tp_join(parts, *rule, dims) if rule and tp_size > 1 else parts[0]
            if m:
                name = f"{m.group(1)}{int(m.group(2)) + ep_rank * per_rank}{m.group(3)}"
            full[name] = t
    return full


# ---------------------------------------------------------------- model level


def local_megatron_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's own tensors (no `_extra_state` placeholders), grouped experts under
    SequentialMLP's per-expert names (views: consumer/train/experts.py)."""
    return sequential_names({k: v for k, v in model.state_dict().items()
                             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}, model)
