"""Each loss and its gradient against a direct, loop-by-loop implementation of
the formulas in docs/algorithm.md, on hand-made tensors covering every mask case
and the IS truncation."""
from __future__ import annotations

import math

import pytest
import torch

from typing import get_args

from rlstream.common.config import LossName, LossSettings
from rlstream.common.errors import ConfigError
from rlstream.consumer.train.losses import (
    LOSSES,
    LossInputs,
    advantage_mode,
    decoupled_token_mask,
    get_loss_fn,
)

CFG = LossSettings(eps_low=0.2, eps_high=0.27, is_cap=5.0)

# Three responses, 5 positions. Per token: (r = pi/pi_old, w = pi/mu_old).
# Response 0, A > 0: r above 1+eps_high (masked), inside, below 1-eps_low (kept),
#   w above C (truncated); last position is padding.
# Response 1, A < 0: r below 1-eps_low (masked), above 1+eps_high (kept), inside.
# Response 2, A = 0: nothing masked; a truncated token.
RATIOS = [[1.40, 1.10, 0.50, 1.00, 1.0],
          [0.60, 1.50, 0.95, 1.0, 1.0],
          [2.00, 0.30, 1.00, 1.0, 1.0]]
ISW = [[1.20, 0.90, 7.00, 1.00, 1.0],
       [0.80, 6.00, 1.10, 1.0, 1.0],
       [9.00, 1.00, 1.00, 1.0, 1.0]]
MASK = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
ADV = [0.75, -0.5, 0.0]
SW = [1.0, 0.5, 1.0]
LOGP = [[-1.0, -2.0, -0.5, -3.0, -0.1],
        [-0.7, -1.2, -2.5, -0.3, -0.2],
        [-1.5, -0.9, -0.4, -0.6, -0.8]]
NUM_RESPONSES = 4  # pretend the global mini-batch has one more response on another rank
NUM_TOKENS = 13


def make_inputs() -> LossInputs:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    r, w = torch.tensor(RATIOS, dtype=torch.float64), torch.tensor(ISW, dtype=torch.float64)
    return LossInputs(
        logprobs=logp, old_logprobs=(logp.detach() - r.log()),
        rollout_logprobs=(logp.detach() - w.log()), mask=torch.tensor(MASK).bool(),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        sample_weight=torch.tensor(SW, dtype=torch.float64),
        num_responses=NUM_RESPONSES, num_tokens=NUM_TOKENS)


def tokens():
    """Yield (i, t, r, w, A, sw) for every response token, straight from the tables."""
    for i in range(3):
        for t in range(5):
            if MASK[i][t]:
                yield i, t, RATIOS[i][t], ISW[i][t], ADV[i], SW[i]


def length(i):
    return sum(MASK[i])


# ---------------------------------------------------------------- reference formulas
# Each returns (objective J, dJ/dlogp as a 3x5 list); loss = -J.


def ref_minirl(is_correction=True, length_norm=False):
    grad = [[0.0] * 5 for _ in range(3)]
    total = 0.0
    for i, t, r, w, a, sw in tokens():
        masked = (a > 0 and r > 1 + CFG.eps_high) or (a < 0 and r < 1 - CFG.eps_low)
        m = 0.0 if masked else 1.0
        weight = min(w, CFG.is_cap) if is_correction else 1.0
        norm = length(i) if length_norm else 1.0
        coef = sw * m * weight * a / norm / NUM_RESPONSES
        total += coef * LOGP[i][t]
        grad[i][t] = coef  # d(coef * logp)/dlogp: coef is stop-gradient
    return total, grad


def ref_grpo():
    grad = [[0.0] * 5 for _ in range(3)]
    total = 0.0
    for i, t, r, w, a, sw in tokens():
        clipped = min(max(r, 1 - CFG.eps_low), 1 + CFG.eps_high)
        scale = sw / length(i) / NUM_RESPONSES
        total += scale * min(r * a, clipped * a)
        # d(r*A)/dlogp = r*A when the unclipped branch is the active minimum
        grad[i][t] = scale * r * a if r * a <= clipped * a else 0.0
    return total, grad


def ref_cispo():
    grad = [[0.0] * 5 for _ in range(3)]
    total = 0.0
    for i, t, r, w, a, sw in tokens():
        coef = sw * min(max(r, 1 - CFG.eps_low), 1 + CFG.eps_high) * a / NUM_TOKENS
        total += coef * LOGP[i][t]
        grad[i][t] = coef
    return total, grad


# DPPO thresholds chosen so that every mask case of the tables occurs (p = exp(LOGP), q = p / w):
# response 0 (A > 0): t2 rose p - q = 0.52 (masked), t1 fell (kept: the other side);
# response 1 (A < 0): t0 fell q - p = 0.124, Bernoulli KL 0.031 (masked), t1 rose (kept);
# response 2 (A = 0): nothing fell far enough to be masked.
DPPO_CFG = {"dppo_tv": LossSettings(is_cap=5.0, delta_low=0.1, delta_high=0.15),
            "dppo_kl": LossSettings(is_cap=5.0, delta_low=0.02, delta_high=0.05)}


def bernoulli_kl(q, p):
    """KL(Bernoulli(q) || Bernoulli(p))."""
    return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))


def ref_dppo(name, cfg):
    grad = [[0.0] * 5 for _ in range(3)]
    total = 0.0
    for i, t, r, w, a, sw in tokens():
        p = math.exp(LOGP[i][t])
        q = p / w
        if name == "dppo_tv":
            masked = (p - q > cfg.delta_high) if a > 0 else (q - p > cfg.delta_low)
        else:
            d = bernoulli_kl(q, p)
            masked = (p > q and d > cfg.delta_high) if a > 0 else (p < q and d > cfg.delta_low)
        coef = sw * (0.0 if masked else 1.0) * min(w, cfg.is_cap) * a / NUM_RESPONSES
        total += coef * LOGP[i][t]
        grad[i][t] = coef
    return total, grad


REFERENCES = {
    "dppo_tv": lambda: ref_dppo("dppo_tv", DPPO_CFG["dppo_tv"]),
    "dppo_kl": lambda: ref_dppo("dppo_kl", DPPO_CFG["dppo_kl"]),
    "minirl": lambda: ref_minirl(),
    "minirl_no_is": lambda: ref_minirl(is_correction=False),
    "minirl_length_norm": lambda: ref_minirl(length_norm=True),
    "grpo": ref_grpo,
    "cispo": ref_cispo,
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_loss_and_gradient_match_formula(name):
    inp = make_inputs()
    loss, metrics = get_loss_fn(name)(inp, DPPO_CFG.get(name, CFG))
    loss.backward()
    want_j, want_grad = REFERENCES[name]()
    assert loss.item() == pytest.approx(-want_j, rel=1e-12, abs=1e-12)
    got = inp.logprobs.grad
    want = -torch.tensor(want_grad, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert metrics["tokens"] == 10


def test_minirl_mask_cases_and_truncation():
    inp = make_inputs()
    keep = decoupled_token_mask(torch.tensor(RATIOS), torch.tensor(ADV), CFG)
    assert keep.tolist() == [[False, True, True, True, True],
                             [False, True, True, True, True],
                             [True, True, True, True, True]]
    _, m = get_loss_fn("minirl")(inp, CFG)
    assert m["clip_frac"] == pytest.approx(2 / 10)
    assert m["is_truncated_frac"] == pytest.approx(3 / 10)  # w = 7, 6, 9 exceed C = 5
    assert m["is_weight_max"] == pytest.approx(9.0)
    want_mean = sum(w for _i, _t, _r, w, _a, _s in tokens()) / 10
    assert m["is_weight_mean"] == pytest.approx(want_mean)


def test_truncated_token_gradient_uses_cap():
    """The w=7 token (response 0, t=2, A>0, r=0.5, kept) is weighted by C=5 exactly."""
    inp = make_inputs()
    loss, _ = get_loss_fn("minirl")(inp, CFG)
    loss.backward()
    want = -(SW[0] * 5.0 * ADV[0]) / NUM_RESPONSES
    assert inp.logprobs.grad[0, 2].item() == pytest.approx(want, rel=1e-12)


def test_padding_never_contributes():
    inp = make_inputs()
    loss, _ = get_loss_fn("minirl")(inp, CFG)
    loss.backward()
    assert inp.logprobs.grad[~inp.mask].abs().sum() == 0
    inp2 = make_inputs()
    inp2.logprobs.data[~inp2.mask] = 123.0
    assert get_loss_fn("minirl")(inp2, CFG)[0].item() == pytest.approx(loss.item())


def test_grpo_clip_fraction_counts_active_clipping():
    _, m = get_loss_fn("grpo")(make_inputs(), CFG)
    # active clipping: (A>0, r=1.4) and (A<0, r=0.6); A=0 never clipped
    assert m["clip_frac"] == pytest.approx(2 / 10)
    _, m = get_loss_fn("cispo")(make_inputs(), CFG)
    # CISPO: r outside [0.8, 1.27]: 1.4, 0.5, 0.6, 1.5, 2.0, 0.3
    assert m["clip_frac"] == pytest.approx(6 / 10)


def test_is_truncation_truly_caps_at_C():
    """Doubling an untruncated w doubles the token's weight; beyond C it does not move."""
    cfg = LossSettings(is_cap=5.0)
    for w, expect in [(2.0, 2.0), (4.0, 4.0), (5.0, 5.0), (50.0, 5.0)]:
        logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
        inp = LossInputs(logp, logp.detach(), logp.detach() - math.log(w),
                         torch.ones(1, 1, dtype=torch.bool), torch.tensor([1.0], dtype=torch.float64),
                         torch.ones(1, dtype=torch.float64), 1, 1)
        get_loss_fn("minirl")(inp, cfg)[0].backward()
        assert logp.grad.item() == pytest.approx(-expect)


def test_dppo_masks_exactly_the_tokens_that_left_the_trust_region():
    """Each mask case of the tables (comment above DPPO_CFG), and clip_frac counts them."""
    for name in ("dppo_tv", "dppo_kl"):
        _, m = get_loss_fn(name)(make_inputs(), DPPO_CFG[name])
        assert m["clipped"].tolist() == [[False, False, True, False, False],
                                         [True, False, False, False, False],
                                         [False, False, False, False, False]], name
        assert m["clip_frac"] == pytest.approx(2 / 10)


def test_dppo_default_thresholds_are_the_recipes():
    """Unset deltas: 0.15 (TV) and 0.05 (KL). With the TV default the A < 0 token that fell
    0.124 is kept; its Bernoulli KL 0.031 stays under 0.05 too."""
    for name in ("dppo_tv", "dppo_kl"):
        _, m = get_loss_fn(name)(make_inputs(), LossSettings(name=name))
        assert m["clipped"][1, 0].item() is False and m["clipped"][0, 2].item() is True, name


def test_dppo_mask_follows_the_rollout_policy_not_pi_old():
    """MiniRL masks on r = pi/pi_old; DPPO on pi against mu_old: moving pi_old alone changes
    nothing, moving mu_old does."""
    cfg = DPPO_CFG["dppo_tv"]
    base = get_loss_fn("dppo_tv")(make_inputs(), cfg)[1]["clipped"]
    inp = make_inputs()
    inp.old_logprobs = inp.old_logprobs + 0.5
    assert torch.equal(get_loss_fn("dppo_tv")(inp, cfg)[1]["clipped"], base)
    inp = make_inputs()
    inp.rollout_logprobs = inp.logprobs.detach().clone()  # mu_old = pi: nothing left the region
    assert not get_loss_fn("dppo_tv")(inp, cfg)[1]["clipped"].any()


def test_unknown_loss_name_is_a_config_error():
    with pytest.raises(ConfigError, match="minirl") as e:
        get_loss_fn("ppo2")
    assert e.value.key == "consumer.loss.name"


def test_config_names_exactly_the_registered_losses():
    """common/config/ cannot import torch, so it keeps the names as a Literal."""
    assert sorted(get_args(LossName)) == sorted(LOSSES)


def test_auto_advantage_is_what_each_loss_registered():
    assert advantage_mode(LossSettings(name="grpo")) == "mean_std"
    assert {advantage_mode(LossSettings(name=n)) for n in LOSSES if n != "grpo"} == {"mean"}
    assert advantage_mode(LossSettings(name="dppo_tv")) == "mean"
    assert advantage_mode(LossSettings(name="grpo", advantage="mean")) == "mean"


def test_dynamic_sampling_auto_covers_exactly_the_group_relative_losses():
    """`consumer.dynamic_sampling: auto` filters zero-variance groups for a loss iff its
    advantage is group-relative (mean or mean/std over the group: exactly 0 for a
    group of equal rewards), which is every registered loss today."""
    from rlstream.common.config import DYNAMIC_SAMPLING_LOSSES
    from rlstream.consumer.train.batch import ADVANTAGE_MODES

    group_relative = {name for name, reg in LOSSES.items() if reg.advantage in ADVANTAGE_MODES}
    assert set(DYNAMIC_SAMPLING_LOSSES) == group_relative == set(LOSSES)
