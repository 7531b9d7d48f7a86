"""The trainer's per-step stability signals, overall and by staleness.

Collected during `Trainer.train_step` into its `MetricSums` (tensors on the model's
device, all-reduced over data-parallel ranks with the other sums), then turned into
numbers by `step_signals`. Every token counts in the bucket of its record's
staleness (versions behind the trainer at the gate): 0, 1, ..., 7, and "8+".
Every rank adds the same fixed-size vectors, so the flat all-reduce lines up.

With w = pi/mu_old per response token (untruncated, at each update; on the first
mini-batch pi = pi_old):

    ess               (sum w)^2 / (n sum w^2): the normalised effective sample size of
                      the token IS weights, 1 when every weight is equal, -> 1/n as one
                      token dominates (VCPO, arXiv 2602.17616, predicts collapse with it)
    kl                E[log mu_old - log pi_old] (the old-policy forward): the sampler
                      against the trainer; at staleness 0 the record was sampled by the
                      trainer's current version, so there it is the training-inference
                      mismatch alone (`mismatch_kl`); above, staleness adds to it
    clip_frac         share of tokens the loss masked or clipped (the loss's `clipped`)
    is_truncated_frac share of tokens with w > C (consumer.loss.is_cap)
    token_share       share of the step's tokens in the bucket
"""
from __future__ import annotations

import math

import torch

BUCKETS = 9
"""Staleness 0..7 each, then 8 and more."""
LABELS = tuple(str(s) for s in range(BUCKETS - 1)) + (f"{BUCKETS - 1}+",)
"""Label of each bucket (the `staleness` label of the signal gauge)."""


def bucket_of(staleness: int) -> str:
    """The label of the bucket a record of this staleness counts in."""
    return LABELS[min(max(int(staleness), 0), BUCKETS - 1)]


def _buckets(staleness: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Bucket index of every masked token ([tokens]); staleness None: all 0."""
    if staleness is None:
        return torch.zeros(int(mask.sum()), dtype=torch.long, device=mask.device)
    rows = staleness.to(mask.device).clamp(0, BUCKETS - 1).unsqueeze(-1).expand_as(mask)
    return rows[mask]


def _sum_by(bucket: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(BUCKETS, dtype=torch.float64, device=values.device)
    return out.index_add_(0, bucket, values.detach().to(torch.float64))


def add_old_policy(sums, mask: torch.Tensor, rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                   staleness: torch.Tensor | None) -> None:
    """The old-policy forward's part: sampler-vs-trainer log-prob gap per bucket."""
    b = _buckets(staleness, mask)
    sums.add("sig_old_tokens", _sum_by(b, torch.ones_like(b, dtype=torch.float64)))
    sums.add("sig_kl", _sum_by(b, (rollout_logprobs - old_logprobs)[mask]))


def add_update(sums, mask: torch.Tensor, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
               clipped: torch.Tensor, staleness: torch.Tensor | None, is_cap: float) -> None:
    """One update's part: IS weight moments and masked/truncated counts per bucket."""
    b = _buckets(staleness, mask)
    w = torch.exp(logprobs.detach() - rollout_logprobs)[mask].to(torch.float64)
    sums.add("sig_tokens", _sum_by(b, torch.ones_like(w)))
    sums.add("sig_w", _sum_by(b, w))
    sums.add("sig_w2", _sum_by(b, w * w))
    sums.add("sig_clipped", _sum_by(b, clipped[mask].to(torch.float64)))
    sums.add("sig_truncated", _sum_by(b, (w > is_cap).to(torch.float64)))


def _ess(sw: float, sw2: float, n: float) -> float | None:
    return sw * sw / (n * sw2) if n > 0 and sw2 > 0 else None


def step_signals(s: dict) -> dict:
    """From the reduced sums: `ess`, `mismatch_kl` (None without a record at staleness 0),
    and `by_staleness` {label: {ess, kl, clip_frac, is_truncated_frac, token_share}} for
    every bucket with tokens."""
    n, n_old = s["sig_tokens"], s["sig_old_tokens"]
    total = sum(n)
    by: dict[str, dict] = {}
    for i, label in enumerate(LABELS):
        if not n[i]:
            continue
        by[label] = {"ess": _ess(s["sig_w"][i], s["sig_w2"][i], n[i]),
                     "kl": s["sig_kl"][i] / n_old[i] if n_old[i] else None,
                     "clip_frac": s["sig_clipped"][i] / n[i], "is_truncated_frac": s["sig_truncated"][i] / n[i],
                     "token_share": n[i] / total}
    mismatch = s["sig_kl"][0] / n_old[0] if n_old[0] else None
    return {"ess": _ess(sum(s["sig_w"]), sum(s["sig_w2"]), total),
            "mismatch_kl": None if mismatch is None or math.isnan(mismatch) else mismatch,
            "by_staleness": by}
