"""The tiny Qwen3-MoE model and character tokenizer rlstream builds itself.

Nothing is downloaded: `build_tiny_model(dir)` writes an HF-format directory
(config.json, model.safetensors, tokenizer files, generation_config.json) that
vLLM, transformers and rlstream's Megatron converter all load as is.

The tokenizer is character level (WordLevel over single characters, fused on
decode), enough for the verifiable arithmetic task in `common/tasks/arithmetic.py`.
Facts that shaped the defaults (measured on the CPU test machine): vLLM's CPU attention
rejects head_dim 16, 32 works.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from rlstream.common.tasks.arithmetic import CHARS

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = [PAD, EOS, UNK]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Qwen3-MoE. Defaults are the model the CPU facts above were measured with."""

    vocab_size: int = 64
    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0


def vocab() -> dict[str, int]:
    """Token -> id. Ids 0..2 are <pad>, <eos>, <unk>; then one id per character."""
    return {t: i for i, t in enumerate(SPECIALS + CHARS)}


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over single characters (no downloads)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        model_max_length=TinyModelSpec.max_position_embeddings,
    )


def qwen3_moe_config(spec: TinyModelSpec):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None, eos_token_id=vocab()[EOS], pad_token_id=vocab()[PAD],
        torch_dtype="float32", rope_theta=10000.0, rms_norm_eps=1e-6,
        output_router_logits=False,
    )


def build_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None,
                     overwrite: bool = False) -> Path:
    """Create (or reuse) the tiny model directory and return its path.

    Reuses an existing directory built from the same spec unless `overwrite`.
    Weights are random (seeded); the demo warm-starts them by SFT.
    """
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / "rlstream_tiny_spec.json"
    if not overwrite and marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    cfg = qwen3_moe_config(spec)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    GenerationConfig(eos_token_id=vocab()[EOS], pad_token_id=vocab()[PAD]).save_pretrained(out)
    marker.write_text(json.dumps(asdict(spec), indent=1))
    return out
