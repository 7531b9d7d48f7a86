"""Megatron-core GPT MoE model built from an HF Qwen3-MoE checkpoint.

    dims = read_hf_dims(dir)                # config.json -> HFModelDims
    model = load_hf_checkpoint(dir, layout) # GPTModel with the HF weights (initialises
                                            # the parallel state: consumer/train/parallel.py)
    lp = per_token_logprobs(model, tokens)  # [B, S-1] log p(tokens[:, 1:]), chunked over
                                            # positions (consumer/train/logprobs.py)
    lp = per_token_logprobs(model, tokens, temperature=t)  # softmax(logits / t[b]) per row b

Temperature. A record's log-probs are those of the distribution vLLM sampled
from, softmax(logits / T) (logprobs_mode processed_logprobs), so the trainer
evaluates pi at the record's T too: `temperature` ([B] or None = all 1.0)
divides each row's logits before the log-softmax and the entropy, on both the
tp = 1 and the vocabulary-parallel path (consumer/train/logprobs.py).

The Megatron config mirrors Qwen3-MoE: RMSNorm, q/k RMSNorm per head
(`qk_layernorm`), SwiGLU experts, RoPE (non-interleaved, HF's rotate_half)
with the checkpoint's theta, no biases, top-k softmax routing over the k
selected logits (= softmax then renormalise, Qwen3's `norm_topk_prob=True`),
computed in fp32 (`moe_router_dtype`, as vLLM's top-k), no auxiliary loss, no
shared expert, no dropout. Every model is built with
`moe_enable_routing_replay=True`; with no replay action set the router
behaves normally (see consumer/train/replay.py).

Memory (`consumer.memory`, docs/trainer-scale.md): the core attention is chosen
by consumer/train/attention.py (TE's fused attention or torch SDPA: no [S, S] scores,
no mask; Megatron's local attention only on request); `recompute` turns on full
activation recompute one layer at a time; the log-probs never materialise
[tokens, vocab] logits for a whole micro-batch (the output layer runs per chunk).

On CPU: gloo, `use_cpu_initialization`, the allgather token dispatcher and the
shims of consumer/train/megatron_shims.py. On GPU: NCCL, the alltoall dispatcher.

Experts (`consumer.memory.experts`, consumer/train/experts.py): one grouped GEMM over
a layer's local experts (Transformer Engine's TEGroupedMLP, else torch's
grouped matmul, on CPU too), SequentialMLP only where neither runs; chosen
once per build, logged, kept as `model.experts`. The grouped weights appear
under SequentialMLP's per-expert names (convert.local_megatron_state_dict), so
loading, checkpoints and the HF export do not depend on the choice.

Tensor parallelism. Megatron's MoE layer trains under TP only with sequence
parallelism, so `tp > 1` turns it on: between the attention and expert blocks
each TP rank holds S/tp of the sequence (the forward right-pads the input to a
multiple of tp), its routers route only those tokens (consumer/train/replay.py cuts
and gathers replay indices accordingly), and the norm and router weights, which
every TP rank holds whole, get partial gradients that the optimizer sums over
the TP group. Megatron's own torch norm refuses sequence parallelism, so the
model uses `RMSNorm` below (the same torch.nn.RMSNorm, marked for that sum).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rlstream.common.errors import ConfigError, ModelError
from rlstream.consumer.train import experts as moe_experts
from rlstream.consumer.train import megatron_shims
from rlstream.consumer.train.experts import experts_spec
from rlstream.consumer.train.loader import load_rank_shard
from rlstream.consumer.train.logprobs import chunked_logprobs
from rlstream.consumer.train.parallel import ParallelLayout, init_parallel, padded_length, sequence_shard

DEFAULT_CHUNK_TOKENS = 2048
"""Positions per output-layer chunk when the caller names none (consumer.memory's default)."""

# ---------------------------------------------------------------- model dims


@dataclass(frozen=True)
class HFModelDims:
    """The shape facts of a Qwen3-MoE config.json that the converter needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_ffn_hidden_size: int
    num_experts: int
    topk: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, c: dict) -> "HFModelDims":
        if c.get("model_type") not in ("qwen3_moe", None):
            raise ModelError(f"config.json: model_type {c.get('model_type')!r} is not qwen3_moe")
        if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
            raise ModelError("config.json: dense (mlp_only_layers, decoder_sparse_step) layers "
                             "are not supported; every layer must be MoE")
        if not c.get("norm_topk_prob", True):
            raise ModelError("config.json: norm_topk_prob=False is not supported")
        rope = c.get("rope_parameters") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            moe_ffn_hidden_size=c["moe_intermediate_size"],
            num_experts=c.get("num_experts", c.get("num_local_experts")),
            topk=c["num_experts_per_tok"], rms_norm_eps=c["rms_norm_eps"],
            rope_theta=float(theta), tie_word_embeddings=bool(c.get("tie_word_embeddings")),
            max_position_embeddings=c["max_position_embeddings"],
        )


def read_hf_dims(hf_dir: str | os.PathLike) -> HFModelDims:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} not found: point at an HF Qwen3-MoE directory", "model.path")
    return HFModelDims.from_hf_config(json.loads(path.read_text()))


# ---------------------------------------------------------------- model


def transformer_config(dims: HFModelDims, dtype: torch.dtype = torch.float32,
                       recompute: bool = False, grouped_experts: bool = False):
    """Megatron TransformerConfig equivalent to the HF Qwen3-MoE config; `recompute`:
    full activation recompute, one layer at a time; `grouped_experts`: the experts
    run as one grouped GEMM (consumer/train/experts.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads, num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim, ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        num_moe_experts=dims.num_experts, moe_router_topk=dims.topk,
        moe_router_pre_softmax=False, moe_router_score_function="softmax",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather" if on_cpu else "alltoall",
        moe_grouped_gemm=grouped_experts, moe_enable_routing_replay=True, moe_router_dtype="fp32",
        normalization="RMSNorm", layernorm_epsilon=dims.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=on_cpu,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        # MoE under TP trains only with sequence parallelism (module docstring)
        sequence_parallel=ps.get_tensor_model_parallel_world_size() > 1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm behind Megatron's norm constructor. Unlike Megatron's
    `WrappedTorchNorm` it allows sequence parallelism; its weight is marked
    `sequence_parallel` (see the module docstring)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        # the model's dtype: an fp32 norm in a bf16 model falls off torch's fused kernel
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_norm(spec, norm):
    """A copy of a Megatron layer spec with every torch norm replaced by `norm`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return norm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=_with_norm(spec.submodules, norm))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _with_norm(getattr(spec, f.name), norm)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def layer_specs(dims: HFModelDims, attention: str = "sdpa", experts: str = "sequential"):
    """Megatron block spec: local (non-TE) Qwen3-MoE layers with rlstream's RMSNorm, the
    core attention `attention` (resolved, consumer/train/attention.py) and the MoE experts
    module `experts` (resolved, consumer/train/experts.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from rlstream.consumer.train.attention import core_attention  # defers Megatron

    layer = get_gpt_layer_local_spec(num_experts=dims.num_experts, moe_grouped_gemm=False,
                                     qk_layernorm=True, normalization="RMSNorm")
    layer = _with_norm(layer, RMSNorm)
    sa = layer.submodules.self_attention
    sa = dataclasses.replace(sa, submodules=dataclasses.replace(
        sa.submodules, core_attention=core_attention(attention)))
    moe = layer.submodules.mlp
    moe = dataclasses.replace(moe, submodules=dataclasses.replace(
        moe.submodules, experts=experts_spec(experts)))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, self_attention=sa, mlp=moe))
    return TransformerBlockSubmodules(layer_specs=[layer] * dims.num_layers, layer_norm=RMSNorm)


def build_model(dims: HFModelDims, dtype: torch.dtype = torch.float32,
                attention: str = "auto", recompute: bool = False, experts: str = "auto"):
    """An uninitialised-weights GPTModel (parallel state must be initialised).
    `attention`, `recompute` and `experts`: `consumer.memory` (common/config/consumer.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from rlstream.consumer.train.attention import resolve  # defers Megatron

    megatron_shims.apply()
    attention = resolve(attention)
    experts = moe_experts.resolve(
        experts, dims.hidden_size,
        dims.moe_ffn_hidden_size // ps.get_expert_tensor_parallel_world_size(), dtype)
    before = len(RouterReplay.global_router_replay_instances)
    model = GPTModel(
        config=transformer_config(dims, dtype, recompute, grouped_experts=experts != "sequential"),
        transformer_layer_spec=layer_specs(dims, attention, experts),
        vocab_size=dims.vocab_size, max_sequence_length=dims.max_position_embeddings,
        # under TP each rank keeps its vocabulary shard of the logits
        # (consumer/train/logprobs.py); with tp = 1 this changes nothing
        pre_process=True, post_process=True, parallel_output=True,
        share_embeddings_and_output_weights=dims.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=dims.rope_theta, rotary_percent=1.0,
    )
    # Megatron keeps every RouterReplay in one process-global list; rlstream
    # addresses each model's own routers (consumer/train/replay.py), so several models
    # (tests, old/new policies) can live in one process.
    del RouterReplay.global_router_replay_instances[before:]
    model.hf_dims, model.attention, model.experts = dims, attention, experts
    if torch.cuda.is_available():
        model.cuda()
    return model


def load_hf_checkpoint(hf_dir: str | os.PathLike, par: ParallelLayout | None = None,
                       dtype: torch.dtype = torch.float32, attention: str = "auto",
                       recompute: bool = False, experts: str = "auto"):
    """Build the Megatron model for `hf_dir` and load its safetensors weights.

    Initialises the parallel state (`par`, default world of one) if needed.
    Each rank reads only its own tensor/expert-parallel shard (consumer/train/loader.py).
    """
    init_parallel(par or ParallelLayout())
    dims = read_hf_dims(hf_dir)
    model = build_model(dims, dtype, attention, recompute, experts)
    load_rank_shard(model, hf_dir)
    return model


# ---------------------------------------------------------------- forward


def _forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """GPTModel's output [B, S_pad(, V)] for input ids [B, S], right-padded to
    `padded_length` (right padding never influences real positions: causal)."""
    from rlstream.consumer.train.attention import needs_mask  # defers Megatron

    device = next(model.parameters()).device
    tokens = tokens.to(device)
    seq, full = tokens.shape[1], padded_length(tokens.shape[1], model)
    if full != seq:
        tokens = F.pad(tokens, (0, full - seq), value=0)
    position_ids = torch.arange(full, device=device).unsqueeze(0).expand_as(tokens)
    mask = (megatron_shims.causal_attention_mask(full, device)
            if needs_mask(getattr(model, "attention", "local")) else None)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=mask)


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] (float32) for input ids [B, S] (right-padded is fine).
    Under tensor parallelism they are this rank's vocabulary shard [B, S, V / tp].
    Full logits of every position: for sampling and tests; training uses
    `per_token_logprobs`, which never holds them for the whole batch."""
    return _forward(model, tokens)[:, :tokens.shape[1]].float()


@contextlib.contextmanager
def _output_layer_skipped(model):
    """GPTModel returns its final hidden states instead of logits inside the block."""
    layer = model.output_layer
    layer.forward = lambda hidden, weight=None, runtime_gather_output=None: (hidden, None)
    try:
        yield
    finally:
        del layer.forward  # back to the class method


def output_head(model):
    """The output layer as a function hidden [c, B, H] -> logits [c * tp, B, V / tp]
    (sequence parallel: it all-gathers the chunk over TP ranks)."""
    weight = (model.shared_embedding_or_output_weight()
              if model.share_embeddings_and_output_weights else None)
    return lambda hidden: model.output_layer(hidden, weight=weight)[0]


def per_token_logprobs(model, tokens: torch.Tensor, with_entropy: bool = False,
                       temperature: torch.Tensor | None = None,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < S-1: [B, S-1] float32
    (and the entropy). `tokens` is [B, S] (prompt + response); the forward input
    is tokens[:, :-1]. The output layer and log-softmax run `chunk_tokens`
    positions at a time (0: all at once); under tensor parallelism on the
    vocabulary shards. `temperature` [B] divides each sample's logits."""
    with _output_layer_skipped(model):
        hidden = _forward(model, tokens[:, :-1])  # [B, S_pad / tp, H]
    return chunked_logprobs(hidden, tokens[:, 1:].to(hidden.device), output_head(model),
                            sequence_shard(model), chunk_tokens, with_entropy, temperature)
