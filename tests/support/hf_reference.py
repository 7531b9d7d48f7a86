"""HF transformers as the independent reference: Qwen3-MoE in fp32 on the same
safetensors, for the log-probs a record or a trainer reports and the routing a vLLM sample
carries (each router's top-k choice replaced by given experts; the proof is stated in
tests/integration/test_routing_capture.py).

    load_hf_model         the HF model, fp32, eager attention
    ReplayRouting         context manager: every router picks the given experts [S, L, K]
    hf_sampled_logprobs   log p(response[t] | prefix) in HF, optionally with replayed routing
    hf_native_routing     HF's own top-k experts for a sequence
    MATCH_TOL             the tolerance a right routing replays within
    hf_record_logprobs    a record's response log-probs at temperature 1, from a model folder
    hf_token_logprobs     per-token log-probs of a batch of token rows, from a model folder
"""
from __future__ import annotations

import numpy as np

# Measured: max abs diff 4.8e-7 with the captured routing; >= 4.9e-3 for every
# perturbed sample. The random tiny model's logits are nearly flat (log-probs
# ~ log 1/64), so a wrong expert moves log-probs by only 1e-3..1e-1; a wrong
# routing must therefore fail the very tolerance the correct one passes.
MATCH_TOL = 1e-4


def load_hf_model(model_dir):
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    return model.eval()


class ReplayRouting:
    """Context manager replacing every Qwen3-MoE router's top-k by given experts.

    `routing` is [S, L, K] (S = sequence length, batch 1). The router still
    computes its logits from the hidden states; only the choice of experts is
    replayed, and their gate weights are the softmax probabilities at those
    experts, renormalised over them.
    """

    def __init__(self, model, routing: np.ndarray):
        self.model = model
        self.routing = routing
        self.saved = []

    def __enter__(self):
        import torch
        import torch.nn.functional as F

        for layer_idx, layer in enumerate(self.model.model.layers):
            gate = layer.mlp.gate
            idx = torch.as_tensor(self.routing[:, layer_idx, :].astype(np.int64))

            def forward(hidden_states, gate=gate, idx=idx):
                hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
                assert hidden_states.shape[0] == idx.shape[0], "routing rows != tokens"
                logits = F.linear(hidden_states, gate.weight)
                probs = torch.softmax(logits, dtype=torch.float, dim=-1)
                weights = probs.gather(1, idx)
                if gate.norm_topk_prob:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                return logits, weights.to(logits.dtype), idx

            self.saved.append((gate, gate.forward))
            gate.forward = forward
        return self

    def __exit__(self, *exc):
        for gate, fwd in self.saved:
            gate.forward = fwd
        self.saved.clear()


def hf_sampled_logprobs(model, sample, routing=None, temperature: float = 1.0) -> np.ndarray:
    """log p(response[t] | prefix) from HF at `temperature`, optionally with replayed routing. float32[T]."""
    import torch

    seq = np.concatenate([sample.prompt_ids, sample.response_ids[:-1]]).astype(np.int64)
    P = sample.prompt_ids.size
    with torch.no_grad():
        if routing is None:
            logits = model(torch.as_tensor(seq)[None]).logits[0]
        else:
            with ReplayRouting(model, routing):
                logits = model(torch.as_tensor(seq)[None]).logits[0]
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)[P - 1:]
        tok = torch.as_tensor(sample.response_ids.astype(np.int64))
        return lp.gather(1, tok[:, None])[:, 0].numpy()


def hf_native_routing(model, sample) -> np.ndarray:
    """HF's own top-k experts for the sequence, [S, L, K] (for an agreement figure)."""
    import torch

    seq = np.concatenate([sample.prompt_ids, sample.response_ids[:-1]]).astype(np.int64)
    picks = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: picks.append(o[2].numpy().copy()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.as_tensor(seq)[None])
    finally:
        for h in hooks:
            h.remove()
    return np.stack(picks, axis=1)


def hf_record_logprobs(model_dir, r) -> np.ndarray:
    """log p(response[t] | prefix) of record `r` under the HF model in `model_dir`. float32[T]."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.concatenate([r.prompt_ids, r.response_ids])[None].astype(np.int64))
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0, :-1].float(), -1)
    P = len(r.prompt_ids)
    return lp[P - 1:, :].gather(-1, ids[0, P:, None])[:, 0].numpy()


def hf_token_logprobs(hf_dir, tokens):
    """[B, S-1] log p(tokens[:, t+1] | tokens[:, :t+1]) under the HF model in `hf_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.consumer.train.logprobs import logprobs_from_logits

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits[:, :-1]
    return logprobs_from_logits(logits, tokens[:, 1:])
