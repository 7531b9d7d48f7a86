"""Policy-gradient losses: MiniRL (docs/algorithm.md), its ablations, GRPO, CISPO, DPPO.

Pure functions over one mini-batch, each registered once under its name
(`@register_loss`) with the advantage it expects, selected with
`get_loss_fn(name)`. Every function takes `(inp: LossInputs, cfg: LossSettings)`
(`consumer.loss` of the config, common/config/consumer.py) and returns `(loss,
metrics)`; `loss` is a scalar to *minimise* (minus the objective).
`rlstream.common.config.LossName` lists the registered names for the config loader
(which imports no torch); a unit test keeps the two equal.

Shapes (B responses in this rank's mini-batch, S positions):
    logprobs          float[B, S]  log pi(y_t), with grad (current policy)
    old_logprobs      float[B, S]  log pi_old(y_t), no grad (trainer, before updates)
    rollout_logprobs  float[B, S]  log mu_old(y_t), no grad (inference engine)
    mask              bool [B, S]  True on response tokens
    advantages        float[B]     per response (built by consumer/train/batch.py)
    sample_weight     float[B]     staleness decay gamma**s (1.0 by default)
Positions that are not response tokens are ignored (their values may be
anything finite).

Global constant scaling (the paper leaves it free; this is our choice):
  * minirl, minirl_no_is, minirl_length_norm, grpo, dppo_tv, dppo_kl divide the summed objective
    by `num_responses`, the number of responses in the *global* mini-batch
    (all data-parallel ranks). With data parallelism the per-rank gradients
    are summed, so the result is independent of how the mini-batch is split.
  * cispo divides by `num_tokens`, the number of response tokens in the global
    mini-batch (the paper's 1 / sum_i |y_i|).

MiniRL, per token (A = advantage, r = pi/pi_old, w = pi/mu_old):
    M_t  = 0 if (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low) else 1
    J    = sum_i sum_t M_t * sg[min(w, C)] * A_i * log pi(y_t)
`minirl_no_is` drops sg[min(w, C)] (sets it to 1); `minirl_length_norm`
divides each response's sum by its length |y_i|.
GRPO: sum_i (1/|y_i|) sum_t min(r A, clip(r, 1-eps_low, 1+eps_high) A).
CISPO: sum_i sum_t sg[clip(r, 1-eps_low, 1+eps_high)] A log pi (never masks).

DPPO (Qi et al., arXiv 2602.04879; as verl, TRL and SkyRL implement it), with
p = pi(y_t), q = mu_old(y_t) (the rollout policy: the trust region is anchored
on the sampler, so it covers training-inference mismatch and staleness alike):
    J    = sum_i sum_t M_t * sg[min(w, C)] * A_i * log pi(y_t)
    dppo_tv: M_t = 0 iff (A > 0 and p - q > delta_high) or (A <= 0 and q - p > delta_low)
    dppo_kl: D = q log(q/p) + (1-q) log((1-q)/(1-p))  (the Bernoulli KL of the token)
             M_t = 0 iff (A > 0 and p > q and D > delta_high) or (A <= 0 and p < q and D > delta_low)
Top-K DPPO needs the sampler's top-K log-probs per position, which records do not carry.

Metrics (means over this rank's response tokens, detached floats):
  is_weight_mean / is_weight_max: untruncated w = pi/mu_old; is_truncated_frac:
  share of tokens with w > C; clip_frac: share of tokens masked (MiniRL, DPPO) or
  clipped (GRPO: the clipped branch is the active one; CISPO: r outside the
  range); ratio_mean: mean r; tokens: number of response tokens; and one tensor,
  `clipped`: bool[B, S], the tokens counted in clip_frac (the trainer splits the
  share by staleness: consumer/stability/signals.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlstream.common.config import LossSettings
from rlstream.common.errors import ConfigError


@dataclass
class LossInputs:
    """One mini-batch on this rank (shapes in the module docstring)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    sample_weight: torch.Tensor
    num_responses: int
    num_tokens: int


LossFn = Callable[[LossInputs, LossSettings], "tuple[torch.Tensor, dict]"]


@dataclass(frozen=True)
class RegisteredLoss:
    fn: LossFn
    advantage: str
    """The advantage mode consumer/train/batch.py builds for it under `advantage: auto`."""


LOSSES: dict[str, RegisteredLoss] = {}


def register_loss(name: str, advantage: str = "mean") -> Callable[[LossFn], LossFn]:
    """Register a loss under `name` (add it to rlstream.common.config.LossName too)."""
    def add(fn: LossFn) -> LossFn:
        LOSSES[name] = RegisteredLoss(fn, advantage)
        return fn
    return add


# ---------------------------------------------------------------- shared pieces


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return float((x * mask).sum() / n) if n > 0 else 0.0


def _base_metrics(inp: LossInputs, cfg: LossSettings, ratio: torch.Tensor, clipped: torch.Tensor) -> dict:
    m = inp.mask
    w = torch.exp(inp.logprobs.detach() - inp.rollout_logprobs)
    clipped = clipped & m
    return {
        "is_weight_mean": _masked_mean(w, m),
        "is_weight_max": float(w[m].max()) if m.any() else 0.0,
        "is_truncated_frac": _masked_mean((w > cfg.is_cap).float(), m),
        "clip_frac": _masked_mean(clipped.float(), m),
        "ratio_mean": _masked_mean(ratio, m),
        "tokens": float(m.sum()),
        "clipped": clipped,
    }


def _truncated_is_weight(inp: LossInputs, cfg: LossSettings) -> torch.Tensor:
    """sg[min(w, C)], w = pi/mu_old."""
    return torch.exp(inp.logprobs.detach() - inp.rollout_logprobs).clamp(max=cfg.is_cap)


def _ratio(inp: LossInputs) -> torch.Tensor:
    """r = pi / pi_old, detached."""
    return torch.exp(inp.logprobs.detach() - inp.old_logprobs)


def decoupled_token_mask(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    """M_t of MiniRL: False where A > 0 and r > 1+eps_high, or A < 0 and r < 1-eps_low."""
    a = adv.unsqueeze(-1)
    drop = ((a > 0) & (ratio > 1 + cfg.eps_high)) | ((a < 0) & (ratio < 1 - cfg.eps_low))
    return ~drop


# ---------------------------------------------------------------- MiniRL family


def _minirl(inp: LossInputs, cfg: LossSettings, is_correction: bool, length_norm: bool):
    ratio = _ratio(inp)
    keep = decoupled_token_mask(ratio, inp.advantages, cfg) & inp.mask
    w = _truncated_is_weight(inp, cfg) if is_correction else torch.ones_like(inp.logprobs)
    per_token = keep * w * inp.advantages.unsqueeze(-1) * inp.logprobs
    per_resp = per_token.sum(-1)
    if length_norm:
        per_resp = per_resp / inp.mask.sum(-1).clamp(min=1)
    loss = -(inp.sample_weight * per_resp).sum() / inp.num_responses
    return loss, _base_metrics(inp, cfg, ratio, ~keep)


@register_loss("minirl")
def minirl(inp: LossInputs, cfg: LossSettings):
    """The paper's MiniRL: truncated IS weight, decoupled token mask, plain sum."""
    return _minirl(inp, cfg, is_correction=True, length_norm=False)


@register_loss("minirl_no_is")
def minirl_no_is(inp: LossInputs, cfg: LossSettings):
    """Ablation: MiniRL without the training-inference IS correction."""
    return _minirl(inp, cfg, is_correction=False, length_norm=False)


@register_loss("minirl_length_norm")
def minirl_length_norm(inp: LossInputs, cfg: LossSettings):
    """Ablation: MiniRL with each response's sum divided by its length."""
    return _minirl(inp, cfg, is_correction=True, length_norm=True)


# ---------------------------------------------------------------- baselines


@register_loss("grpo", advantage="mean_std")
def grpo(inp: LossInputs, cfg: LossSettings):
    """GRPO (PPO-clip surrogate, per-response length mean); no discrepancy correction."""
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)  # with grad
    a = inp.advantages.unsqueeze(-1)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a
    surrogate = torch.minimum(unclipped, clipped) * inp.mask
    per_resp = surrogate.sum(-1) / inp.mask.sum(-1).clamp(min=1)
    loss = -(inp.sample_weight * per_resp).sum() / inp.num_responses
    return loss, _base_metrics(inp, cfg, ratio.detach(), clipped.detach() < unclipped.detach())


@register_loss("cispo")
def cispo(inp: LossInputs, cfg: LossSettings):
    """CISPO: stop-gradient clipped ratio times A log pi; never masks a token."""
    ratio = _ratio(inp)
    w = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = w * inp.advantages.unsqueeze(-1) * inp.logprobs * inp.mask
    per_resp = per_token.sum(-1)
    loss = -(inp.sample_weight * per_resp).sum() / max(inp.num_tokens, 1)
    outside = (ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)
    return loss, _base_metrics(inp, cfg, ratio, outside)


# ---------------------------------------------------------------- DPPO

DPPO_DEFAULT_DELTA = {"dppo_tv": 0.15, "dppo_kl": 0.05}
"""Each variant's threshold when `consumer.loss.delta_low/high` are unset (verl's
examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh, the Qwen3-30B-A3B-Base recipe)."""


def dppo_token_mask(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, adv: torch.Tensor,
                    divergence: str, delta_low: float, delta_high: float) -> torch.Tensor:
    """M_t of DPPO (module docstring): False where the token left the trust region around
    the rollout policy in the direction its advantage pushes it."""
    p, q = torch.exp(logprobs), torch.exp(rollout_logprobs)
    if divergence == "tv":
        rose, fell = p - q > delta_high, q - p > delta_low
    else:
        one = 1 - 1e-7  # 1 - p underflows for a near-certain token
        d = q * (rollout_logprobs - logprobs) + (1 - q) * (torch.log1p(-q.clamp(max=one))
                                                           - torch.log1p(-p.clamp(max=one)))
        rose, fell = (p > q) & (d > delta_high), (p < q) & (d > delta_low)
    return ~torch.where(adv.unsqueeze(-1) > 0, rose, fell)


def _dppo(inp: LossInputs, cfg: LossSettings, name: str):
    default = DPPO_DEFAULT_DELTA[name]
    low = cfg.delta_low if cfg.delta_low is not None else default
    high = cfg.delta_high if cfg.delta_high is not None else default
    lp = inp.logprobs.detach()
    keep = dppo_token_mask(lp, inp.rollout_logprobs, inp.advantages, name.removeprefix("dppo_"), low, high)
    keep = keep & inp.mask
    per_token = keep * _truncated_is_weight(inp, cfg) * inp.advantages.unsqueeze(-1) * inp.logprobs
    loss = -(inp.sample_weight * per_token.sum(-1)).sum() / inp.num_responses
    return loss, _base_metrics(inp, cfg, _ratio(inp), ~keep)


@register_loss("dppo_tv")
def dppo_tv(inp: LossInputs, cfg: LossSettings):
    """DPPO-Binary-TV: MiniRL's weighted log pi, masked by the token's probability change
    against the rollout policy instead of the ratio against pi_old."""
    return _dppo(inp, cfg, "dppo_tv")


@register_loss("dppo_kl")
def dppo_kl(inp: LossInputs, cfg: LossSettings):
    """DPPO-Binary-KL: as dppo_tv, the mask on the token's Bernoulli KL to the rollout policy."""
    return _dppo(inp, cfg, "dppo_kl")


def get_loss_fn(name: str) -> LossFn:
    """The loss function registered as `name`."""
    try:
        return LOSSES[name].fn
    except KeyError:
        raise ConfigError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}",
                          "consumer.loss.name") from None


def advantage_mode(cfg: LossSettings) -> str:
    """The advantage mode for `cfg`: its own, or under `auto` the one its loss registered."""
    if cfg.advantage != "auto":
        return cfg.advantage
    get_loss_fn(cfg.name)  # unknown name: the ConfigError above
    return LOSSES[cfg.name].advantage
