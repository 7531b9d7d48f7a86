"""Start-up: each rank reads from the HF checkpoint only the tensors it keeps.

    load_rank_shard(model, hf_dir)            # this rank's Megatron tensors, copied into `model`
    read_rank_shard(reader, dims, tp_rank, tp, ep_rank, ep)   # the same, as a dict (tests)

Before, every rank loaded the whole checkpoint (61 GB at Qwen3-30B-A3B),
fused gate and up of all 128 x 48 experts (about 39 GB more) and then kept
its shard. Here a rank opens the safetensors files (`safe_open`: memory
mapped) and reads, per tensor, only its slice (`get_slice`): its vocabulary
rows, its query groups of q/k/v, its columns of the output projections, its
half of each expert's gate/up rows and down columns, and only the experts of
its expert-parallel rank. The result equals `layout.shard_megatron(
layout.hf_to_megatron(all tensors))` bit for bit (tests/integration/
test_megatron_model.py); `ShardReader.bytes_read` counts what was read.

Tensor-parallel cuts (Megatron's, consumer/train/layout.py `_TP_RULES`): rows of
the embedding and lm_head; query groups of the fused QKV; columns of
o_proj and down_proj; rows of gate and of up, each cut on its own, then
concatenated. Norms and routers are read whole.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from rlstream.common.errors import ConfigError, ParallelLayoutError
# the name maps and cuts are layout.py's (one place for the HF <-> Megatron layout)
from rlstream.consumer.train.layout import (
    _EXPERT,
    _LAYER_RENAMES,
    HF_LAYER,
    MG_LAYER,
    _check_keys,
    _fuse_qkv,
    tp_rule,
    check_shardable,
    hf_keys,
    local_megatron_state_dict,
)
from rlstream.consumer.train.parallel import ranks


class ShardReader:
    """Slices of the tensors of an HF directory (single file, or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        d = Path(hf_dir)
        index = d / "model.safetensors.index.json"
        if index.exists():
            self.file_of = {k: d / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (d / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(str(d / "model.safetensors"), framework="pt") as f:
                self.file_of = {k: d / "model.safetensors" for k in f.keys()}
        else:
            raise ConfigError(f"no model.safetensors in {d}", "model.path")
        self._open: dict[Path, object] = {}
        self.bytes_read = 0
        self.keys_read: set[str] = set()

    def keys(self) -> set[str]:
        return set(self.file_of)

    def shape(self, key: str) -> list[int]:
        return self._handle(key).get_slice(key).get_shape()

    def rows(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Rows lo:hi of `key` (all: the whole tensor)."""
        return self._read(key, lambda s: s[lo:hi])

    def cols(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Columns lo:hi of the matrix `key`."""
        return self._read(key, lambda s: s[:, lo:hi])

    def _read(self, key: str, cut) -> torch.Tensor:
        t = cut(self._handle(key).get_slice(key)).contiguous()
        self.bytes_read += t.numel() * t.element_size()
        self.keys_read.add(key)
        return t

    def _handle(self, key: str):
        from safetensors import safe_open

        path = self.file_of[key]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt").__enter__()
        return self._open[path]

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def _cut(n: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of part `rank` of `size` equal parts of n."""
    return n // size * rank, n // size * (rank + 1)


def read_rank_shard(reader: ShardReader, dims, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0,
                    ep: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron state dict of rank (tp_rank, ep_rank): local names, local experts."""
    check_shardable(dims, tp, ep)
    keys = reader.keys() - ({"lm_head.weight"} if dims.tie_word_embeddings else set())
    _check_keys(dict.fromkeys(keys), hf_keys(dims), "HF checkpoint")
    vocab = _cut(dims.vocab_size, tp_rank, tp)
    out = {"embedding.word_embeddings.weight": reader.rows("model.embed_tokens.weight", *vocab),
           "decoder.final_layernorm.weight": reader.rows("model.norm.weight")}
    if not dims.tie_word_embeddings:
        out["output_layer.weight"] = reader.rows("lm_head.weight", *vocab)
    for i in range(dims.num_layers):
        out.update(_attention(reader, dims, i, tp_rank, tp))
        out.update(_experts(reader, dims, i, tp_rank, tp, ep_rank, ep))
    return out


def _attention(reader: ShardReader, dims, i: int, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Norms, router, o_proj columns and the fused QKV of this rank's query groups."""
    h, m = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
    out = {}
    for hs, ms in _LAYER_RENAMES:  # o_proj is the one cut (by columns); the rest are whole
        cut = tp_rule(ms)
        out[m + ms] = reader.cols(h + hs, *_cut(reader.shape(h + hs)[1], tp_rank, tp)) if cut else reader.rows(h + hs)
    groups = dims.num_kv_heads // tp
    g0, q_per = groups * tp_rank, dims.num_heads // dims.num_kv_heads * dims.head_dim
    a = h + "self_attn."
    q = reader.rows(a + "q_proj.weight", g0 * q_per, (g0 + groups) * q_per)
    k = reader.rows(a + "k_proj.weight", g0 * dims.head_dim, (g0 + groups) * dims.head_dim)
    v = reader.rows(a + "v_proj.weight", g0 * dims.head_dim, (g0 + groups) * dims.head_dim)
    local = dataclasses.replace(dims, num_kv_heads=groups, num_heads=dims.num_heads // tp)
    out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(q, k, v, local)
    return out


def _experts(reader: ShardReader, dims, i: int, tp_rank: int, tp: int, ep_rank: int,
             ep: int) -> dict[str, torch.Tensor]:
    """This expert-parallel rank's experts (renumbered from 0), their TP slices."""
    h, m = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
    per_rank = dims.num_experts // ep
    ffn = _cut(dims.moe_ffn_hidden_size, tp_rank, tp)
    out = {}
    for j in range(per_rank):
        e, me = f"{h}mlp.experts.{j + ep_rank * per_rank}.", m + _EXPERT.format(j=j)
        out[me + "linear_fc1.weight"] = torch.cat(
            [reader.rows(e + "gate_proj.weight", *ffn), reader.rows(e + "up_proj.weight", *ffn)], 0)
        out[me + "linear_fc2.weight"] = reader.cols(e + "down_proj.weight", *ffn)
    return out


def load_rank_shard(model, hf_dir: str | os.PathLike) -> int:
    """Copy this rank's tensors of `hf_dir` into `model`; returns the bytes read."""
    tp_rank, tp, ep_rank, ep = ranks()
    reader = ShardReader(hf_dir)
    try:
        local = read_rank_shard(reader, model.hf_dims, tp_rank, tp, ep_rank, ep)
    finally:
        reader.close()
    own = local_megatron_state_dict(model)
    if set(local) != set(own):
        raise ParallelLayoutError(f"this rank's shard of the checkpoint has other tensors than its "
                                  f"model: missing {sorted(set(own) - set(local))[:5]}, unexpected "
                                  f"{sorted(set(local) - set(own))[:5]}", "consumer.parallel")
    with torch.no_grad():
        for name, t in own.items():
            if t.shape != local[name].shape:
                raise ParallelLayoutError(f"{name}: shape {tuple(local[name].shape)} from the "
                                          f"checkpoint, model expects {tuple(t.shape)}", "consumer.parallel")
            t.copy_(local[name])
    return reader.bytes_read
