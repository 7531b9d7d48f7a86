"""Per-token log-probabilities and entropy from the model's final hidden states,
one chunk of positions at a time.

    lp = chunked_logprobs(hidden, targets, head, shard, chunk_tokens)            # [B, S]
    lp, ent = chunked_logprobs(..., with_entropy=True, temperature=t)           # t: [B] or None

Full-vocabulary fp32 logits for a whole micro-batch are the largest tensor of a
training step (32 x 4k tokens x 151,936 x 4 B = 80 GB). Here the output layer (`head`)
runs on `chunk_tokens` positions at a time: in the forward each chunk's logits are
freed once its log-probs are taken, and under autograd each chunk is a
`torch.utils.checkpoint` segment, so backward recomputes one chunk's logits at a time.
The entropy (a metric) is computed per chunk without gradient. `chunk_tokens=0` runs the
whole micro-batch at once without checkpointing (the unchunked path, for comparison).

Tensor parallelism (sequence parallel, consumer/train/model.py): `hidden` is this rank's shard
of the right-padded sequence, [B, S_pad / tp, H]. `head` all-gathers a chunk over the TP
ranks and returns this rank's vocabulary shard [tp * c, B, V / tp] for the positions
{r * S_pad / tp + s0 + j}: the log-prob comes from Megatron's
`vocab_parallel_cross_entropy` and the entropy from two all-reduces, and no rank holds
full-vocabulary logits. Every TP rank gets the whole [B, S] result.

temperature: a per-sample [B] tensor that divides the logits (the sampling temperature
of each rollout) or None (1).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from rlstream.consumer.train.parallel import reduce_over_tensor_parallel

Head = Callable[[torch.Tensor], torch.Tensor]
"""The output layer: hidden [c, B, H] -> logits [c * tp, B, V / tp]."""


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor,
                         with_entropy: bool = False, temperature: torch.Tensor | None = None):
    """log p(targets) [B, T] from full-vocabulary logits [B, T, V] at `temperature` [B]
    (None: 1); optionally the entropy."""
    x = logits.float()
    if temperature is not None:
        x = x / temperature.to(x.device).view(-1, 1, 1)
    logp = torch.log_softmax(x, dim=-1)
    out = logp.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    if not with_entropy:
        return out
    return out, -(logp.exp() * logp).sum(-1)


def _scaled(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits [c, B, V'] divided by the per-sample temperature [B]."""
    x = logits.float()
    return x if temperature is None else x / temperature.to(x.device)[None, :, None]


def _logprob(logits: torch.Tensor, targets: torch.Tensor, tp: int) -> torch.Tensor:
    """log p(targets) [c, B] from fp32 logits [c, B, V / tp] (vocabulary-parallel if tp > 1)."""
    if tp > 1:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(logits.contiguous(), targets)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


@torch.no_grad()
def _entropy(logits: torch.Tensor, tp: int) -> torch.Tensor:
    """Entropy [c, B] of the softmax of fp32 logits [c, B, V / tp] (all TP shards)."""
    m = logits.max(-1).values
    if tp > 1:
        reduce_over_tensor_parallel(m, "max")
    z = logits - m.unsqueeze(-1)
    e = z.exp()
    sums = torch.stack([e.sum(-1), (e * z).sum(-1)])  # sum exp(z), sum exp(z) z
    if tp > 1:
        reduce_over_tensor_parallel(sums, "sum")
    return sums[0].log() - sums[1] / sums[0]  # H = log Z - E_p[z]


def chunked_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: Head,
                     shard: tuple[int, int] = (0, 1), chunk_tokens: int = 2048,
                     with_entropy: bool = False, temperature: torch.Tensor | None = None):
    """log p(targets) [B, S] (and the entropy [B, S]) from hidden [B, S_pad / tp, H].

    targets [B, S] (S <= S_pad, the unpadded length); shard = (rank, size) of the
    sequence split (consumer.parallel.sequence_shard); tp = size is also the
    vocabulary split of `head`'s output."""
    b, local = hidden.shape[0], hidden.shape[1]
    tp, seq = shard[1], targets.shape[1]
    targets = torch.nn.functional.pad(targets.long(), (0, local * tp - seq))
    step = local if chunk_tokens <= 0 else max(1, chunk_tokens // (b * tp))
    grad = torch.is_grad_enabled() and hidden.requires_grad and chunk_tokens > 0

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _logprob(_scaled(head(h), temperature), t, tp)

    lps, ents, where = [], [], []
    for s0 in range(0, local, step):
        c = min(step, local - s0)
        idx = torch.cat([r * local + s0 + torch.arange(c, device=hidden.device) for r in range(tp)])
        h = hidden[:, s0:s0 + c].transpose(0, 1)           # [c, B, H]
        t = targets[:, idx].transpose(0, 1).contiguous()   # [tp * c, B]
        lps.append(checkpoint(piece, h, t, use_reentrant=False) if grad else piece(h, t))
        if with_entropy:
            ents.append(_entropy(_scaled(head(h.detach()), temperature), tp))
        where.append(idx)
    order = torch.cat(where)
    lp = _place(lps, order, local * tp, b)[:, :seq]
    return lp if not with_entropy else (lp, _place(ents, order, local * tp, b)[:, :seq])


def _place(parts: list[torch.Tensor], order: torch.Tensor, full: int, b: int) -> torch.Tensor:
    """Chunks [tp * c, B] at positions `order` -> [B, full]."""
    flat = torch.cat(parts, 0)
    out = flat.new_zeros(full, b).index_copy(0, order, flat)
    return out.transpose(0, 1)
