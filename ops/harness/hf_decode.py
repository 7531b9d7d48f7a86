"""Decoding with a Hugging Face model on CPU, shared by the held-out evaluation
(ops/harness/evaluate.py) and the multi-turn tool evaluation (ops/harness/tool_eval.py).

- `load_model`: (model, tokenizer) in fp32 eval mode.
- `by_length`: prompt indices grouped by token length, so every batch is unpadded.
- `decode_loop`: one equal-length batch decoded with a KV cache, greedy or sampled.

torch and transformers are imported inside the functions: the harness's command line and
its reports import this module without loading them.
"""
from __future__ import annotations

import os
from collections import defaultdict


def load_model(model_dir: str | os.PathLike):
    """(model, tokenizer) in fp32 eval mode on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per evaluation would interleave with the demo's progress lines
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tok


def by_length(token_lists: list[list[int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(token_lists):
        groups[len(ids)].append(i)
    return groups


def decode_loop(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                 temperature: float, generator, stop_ids: frozenset[int] = frozenset()) -> list[list[int]]:
    """Decode one equal-length batch with a KV cache; greedy when temperature == 0.
    A sequence ends at `eos_id` (not returned) or at one of `stop_ids` (returned)."""
    import torch

    x = torch.tensor(prompts, dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    past = None
    for _ in range(max_new_tokens):
        res = model(input_ids=x, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[:, -1, :].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == eos_id:
                    done[i] = True
                else:
                    out[i].append(t)
                    done[i] = t in stop_ids
        if bool(done.all()):
            break
        x = nxt[:, None]
    return out
