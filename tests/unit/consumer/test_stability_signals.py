"""The trainer's stability signals from hand-made tensors: ESS of the token IS weights,
sampler-vs-trainer KL and masked share, overall and per staleness bucket, against
the formulas computed directly."""
from __future__ import annotations

import math

import pytest
import torch

from rlstream.consumer.stability.signals import (
    BUCKETS,
    LABELS,
    add_old_policy,
    add_update,
    bucket_of,
    step_signals,
)


class MetricSums:
    """consumer.trainer.MetricSums on one rank (that module imports Megatron: 25 s):
    sums by key, reduced to floats and lists."""

    def __init__(self, device):
        self.sums = {}

    def add(self, key, value):
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def reduce(self):
        return {k: v.tolist() for k, v in self.sums.items()}, {}

# three responses of ages 0, 2 and 11 versions; 4 positions, the last of row 2 is padding
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
MASK[2, 3] = False
STALENESS = torch.tensor([0, 2, 11])
LOGP = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.2, -1.5, 0.0, 0.0], [-0.7, -0.3, -1.2, 9.0]], dtype=torch.float64)
W = torch.tensor([[1.0, 1.5, 0.5, 1.0], [2.0, 0.25, 1.0, 1.0], [8.0, 1.0, 0.9, 1.0]], dtype=torch.float64)
MU = LOGP - W.log()                       # w = pi / mu_old
OLD = MU - torch.tensor([[0.01, -0.02, 0.03, 0], [0.2, 0.1, 0, 0], [0.5, 0.4, 0.3, 0]], dtype=torch.float64)
CLIPPED = torch.tensor([[0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)


def signals():
    sums = MetricSums(torch.device("cpu"))
    add_old_policy(sums, MASK, MU, OLD, STALENESS)
    add_update(sums, MASK, LOGP, MU, CLIPPED, STALENESS, is_cap=5.0)
    return step_signals(sums.reduce()[0])


def ess(ws):
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


def tokens(row):
    return [(t, W[row, t].item()) for t in range(4) if MASK[row, t]]


def test_overall_ess_and_mismatch():
    s = signals()
    all_w = [w for r in range(3) for _, w in tokens(r)]
    assert s["ess"] == pytest.approx(ess(all_w))
    # mismatch: staleness-0 tokens only, E[log mu - log pi_old]
    assert s["mismatch_kl"] == pytest.approx((0.01 - 0.02 + 0.03) / 3)


def test_per_staleness_buckets():
    by = signals()["by_staleness"]
    assert set(by) == {"0", "2", "8+"}  # 11 versions counts in 8+
    assert by["2"]["ess"] == pytest.approx(ess([2.0, 0.25]))
    assert by["2"]["kl"] == pytest.approx((0.2 + 0.1) / 2)
    assert by["2"]["clip_frac"] == pytest.approx(1.0)
    assert by["0"]["clip_frac"] == pytest.approx(1 / 3)
    assert by["8+"]["clip_frac"] == 0.0  # the clipped padding position does not count
    assert by["8+"]["is_truncated_frac"] == pytest.approx(1 / 3)  # w = 8 > C = 5
    assert sum(b["token_share"] for b in by.values()) == pytest.approx(1.0)
    assert by["8+"]["token_share"] == pytest.approx(3 / 8)


def test_no_fresh_record_means_no_mismatch_figure():
    sums = MetricSums(torch.device("cpu"))
    stale = torch.tensor([3, 3, 3])
    add_old_policy(sums, MASK, MU, OLD, stale)
    add_update(sums, MASK, LOGP, MU, CLIPPED, stale, is_cap=5.0)
    s = step_signals(sums.reduce()[0])
    assert s["mismatch_kl"] is None and set(s["by_staleness"]) == {"3"}


def test_equal_weights_give_ess_one_and_one_dominant_weight_gives_about_one_over_n():
    m = torch.ones(1, 100, dtype=torch.bool)
    lp = torch.zeros(1, 100, dtype=torch.float64)
    for mu, want in ((lp - 0.3, 1.0), (torch.cat([lp[:, :1] - 20, lp[:, 1:]], 1), 1 / 100)):
        sums = MetricSums(torch.device("cpu"))
        add_old_policy(sums, m, mu, lp, None)
        add_update(sums, m, lp, mu, torch.zeros_like(m), None, is_cap=5.0)
        assert step_signals(sums.reduce()[0])["ess"] == pytest.approx(want, rel=1e-3)


def test_bucket_labels():
    assert len(LABELS) == BUCKETS and [bucket_of(s) for s in (0, 1, 7, 8, 500)] == ["0", "1", "7", "8+", "8+"]
    assert not math.isnan(signals()["ess"])
