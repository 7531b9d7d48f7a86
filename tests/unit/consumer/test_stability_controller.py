"""`max_staleness: auto`'s controller on synthetic signal sequences: it tightens when the
signals degrade, loosens when healthy and the trainer waits, holds in the hysteresis band
and never flaps; and its driver yields to an operator's bound."""
from __future__ import annotations

import random

import pytest

from rlstream.common.config import AutoStalenessSettings, ControlSettings
from rlstream.common.control.messages import CONTROLLER
from rlstream.consumer.stability.auto import AutoStaleness
from rlstream.consumer.stability.controller import StalenessController, StepSignals

CFG = AutoStalenessSettings(min=1, max=8, start=4, window=4)  # ess 0.6 / 0.8, kl 0.05 / 0.02, gn 2 / 1.5
HEALTHY_WAITING = StepSignals(ess=0.95, kl=0.005, grad_norm=1.0, wait_share=0.5)
HEALTHY_BUSY = StepSignals(ess=0.95, kl=0.005, grad_norm=1.0, wait_share=0.05)


def run(seq, bound=4, cfg=CFG):
    """Feed `seq`, applying each change as the control topic would; [(step, bound)] after each change."""
    ctl, out = StalenessController(cfg), []
    for i, s in enumerate(seq):
        change = ctl.observe(s, bound)
        if change is not None:
            assert change.bound != bound and cfg.min <= change.bound <= cfg.max
            bound = change.bound
            out.append((i, bound, change))
    return out, bound


def test_healthy_and_waiting_loosens_doubling_until_the_first_tightening_then_by_one():
    changes, bound = run([HEALTHY_WAITING] * 40, bound=1, cfg=AutoStalenessSettings(min=0, max=9, start=1, window=4))
    assert [b for _, b, _ in changes] == [2, 4, 8, 9] and bound == 9  # slow start, capped at max
    steps = [i for i, _, _ in changes]
    assert all(b - a >= CFG.window for a, b in zip(steps, steps[1:]))  # a fresh window between changes
    assert all(c.direction == "loosen" and "healthy" in c.reason for _, _, c in changes)
    assert run([HEALTHY_WAITING] * 40, bound=0)[0][0][1] == 1  # from 0: one
    bad = StepSignals(ess=0.4, kl=0.005, grad_norm=1.0, wait_share=0.5)
    changes, bound = run([bad] * 4 + [HEALTHY_WAITING] * 40, bound=4)
    assert [b for _, b, _ in changes] == [2, 3, 4, 5, 6, 7, 8]  # after a tightening: one at a time


def test_healthy_but_not_waiting_holds():
    assert run([HEALTHY_BUSY] * 40)[0] == []


@pytest.mark.parametrize("bad,signal", [
    (StepSignals(ess=0.4, kl=0.005, grad_norm=1.0, wait_share=0.5), "ess"),
    (StepSignals(ess=0.95, kl=0.2, grad_norm=1.0, wait_share=0.5), "kl"),
])
def test_degraded_signal_halves_the_bound_down_to_min_and_stays(bad, signal):
    changes, bound = run([bad] * 40, bound=8)
    assert [b for _, b, _ in changes] == [4, 2, 1] and bound == 1
    assert {c.signal for _, _, c in changes} == {signal} and all(c.direction == "tighten" for _, _, c in changes)
    assert changes[0][0] == CFG.window - 1  # the first full window decides
    assert f"tighten 8 -> 4: {signal}" in changes[0][2].reason


def test_grad_norm_spike_against_its_own_median_tightens():
    calm = [StepSignals(ess=0.95, kl=0.005, grad_norm=1.0 + 0.05 * (i % 3), wait_share=0.05) for i in range(12)]
    spike = [StepSignals(ess=0.95, kl=0.005, grad_norm=3.0, wait_share=0.05)] * 4
    changes, bound = run(calm + spike)
    assert len(changes) == 1 and changes[0][2].signal == "grad_norm" and bound == 2
    # without earlier steps there is no median: a high first window is no verdict
    assert run(spike * 2)[0] == []


def test_signals_in_the_hysteresis_band_never_move_the_bound():
    """ESS between ess_tighten and ess_loosen, KL between its thresholds, with noise: hold."""
    rng = random.Random(0)
    seq = [StepSignals(ess=rng.uniform(0.62, 0.78), kl=rng.uniform(0.021, 0.049), grad_norm=1.0,
                       wait_share=0.9) for _ in range(200)]
    assert run(seq)[0] == []


def test_no_flapping_on_a_signal_that_crosses_a_threshold_every_step():
    """ESS alternating 0.58 / 0.9 (one step below the tighten threshold, the next above the
    loosen one): the window mean sits in the band, so nothing moves; a naive per-step rule
    would change the bound every step."""
    seq = [StepSignals(ess=0.58 if i % 2 else 0.9, kl=0.005, grad_norm=1.0, wait_share=0.9) for i in range(200)]
    assert run(seq)[0] == []


def test_recovery_after_a_collapse_is_gradual_and_never_flaps():
    """Healthy, then a degraded stretch, then healthy again: it tightens during the bad stretch,
    loosens back one step per window after it, and never reverses within a window."""
    bad = StepSignals(ess=0.3, kl=0.1, grad_norm=1.0, wait_share=0.5)
    seq = [HEALTHY_WAITING] * 20 + [bad] * 12 + [HEALTHY_WAITING] * 40
    changes, bound = run(seq)
    directions = [c.direction for _, _, c in changes]
    assert "tighten" in directions and directions[-1] == "loosen" and bound == 8
    first_loosen_after = next(i for i, _, c in changes if c.direction == "loosen" and i > 20)
    assert first_loosen_after >= 32 + CFG.window - 1  # not before a full healthy window
    steps = [i for i, _, _ in changes]
    assert all(b - a >= CFG.window for a, b in zip(steps, steps[1:]))
    # a direction reverses at most twice: up, down (the bad stretch), up again
    assert sum(a != b for a, b in zip(directions, directions[1:])) <= 2


def test_a_bound_set_by_someone_else_restarts_the_window():
    ctl = StalenessController(CFG)
    bad = StepSignals(ess=0.3, kl=0.005, grad_norm=1.0, wait_share=0.5)
    for _ in range(3):
        assert ctl.observe(bad, 8) is None
    assert ctl.observe(bad, 6) is None  # an operator's 6: the window starts again
    assert [ctl.observe(bad, 6) for _ in range(2)] == [None, None]
    assert ctl.observe(bad, 6).bound == 3


def test_limits_and_thresholds_are_validated():
    with pytest.raises(ValueError, match="min <= start <= max"):
        AutoStalenessSettings(min=3, max=2, start=2)
    with pytest.raises(ValueError, match="healthy side"):
        AutoStalenessSettings(ess_tighten=0.8, ess_loosen=0.6)


class Published(list):
    def __call__(self, key, value, by, reason):
        self.append((key, value, by, reason))


def test_driver_publishes_with_reason_and_yields_to_an_operator():
    published = Published()
    auto = AutoStaleness(CFG, published)
    state = ControlSettings(max_staleness=4, max_staleness_auto=True)
    phases = {"wait": 1.0, "train": 1.0}
    metrics = {"ess": 0.3, "kl_train_inference": 0.001, "grad_norm": 1.0}
    for _ in range(CFG.window):
        auto.after_step(metrics, phases, state)
    assert published == [("max_staleness", 2, CONTROLLER, published[0][3])] and "ess 0.3 < 0.6" in published[0][3]
    assert auto.status(state)["max_staleness_controller"]["last_change"]["bound"] == 2
    operator = ControlSettings(max_staleness=6, max_staleness_auto=False)
    for _ in range(3 * CFG.window):
        assert auto.after_step(metrics, phases, operator) is None
    assert len(published) == 1  # the operator's bound holds however bad the signals


def test_driver_survives_a_failed_publish_and_tries_again():
    calls = []

    def failing(*a):
        calls.append(a)
        raise OSError("broker down")

    auto = AutoStaleness(CFG, failing)
    state = ControlSettings(max_staleness=4, max_staleness_auto=True)
    for _ in range(2 * CFG.window):
        auto.after_step({"ess": 0.3}, {"wait": 0.0, "train": 1.0}, state)
    assert len(calls) == 2 and auto.last is None  # once per window, nothing recorded as done
