"""The stability experiment's arms, its spreads over seeds, tables and plots (common/harness/stability.py),
from hand-made per-arm results."""
from __future__ import annotations

import pytest

from common.harness.stability import arm_specs, main_arm, spread, stability_summary, summarise


def test_arms_cover_the_grid_seed_major_then_the_mismatch_sweeps():
    names = [n for n, _ in arm_specs()]
    assert len(names) == 2 * 2 * 4 * 3 + 3 * 4 + 2 and len(set(names)) == len(names)
    assert names[0] == "main:minirl-none-k0-s0" and names[16] == "main:minirl-none-k0-s1"
    auto = dict(arm_specs())["main:dppo_tv-R3-auto-s2"]
    assert auto["staleness.max_staleness"] == "auto" and auto["consumer.replay"] == "R3"
    fixed = dict(arm_specs())["main:minirl-none-k8-s0"]
    assert fixed["staleness.max_staleness"] == 8 and fixed["staleness.max_staleness_auto"] is False
    assert dict(arm_specs())["mismatch:dppo_kl-t1.3"]["consumer.stress.logprob_temperature_scale"] == 1.3


def test_spread_over_seeds():
    s = spread([0.1, 0.2, None, 0.3, float("nan")])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.2) and s["std"] == pytest.approx(0.1)
    assert (s["min"], s["max"]) == (0.1, 0.3)
    assert spread([None])["mean"] is None and spread([0.5])["std"] == 0.0


def result(acc, collapsed=False, by=None):
    return {"heldout_accuracy": acc, "samples_per_s": 100.0, "ess": 0.9, "collapsed_by_accuracy": collapsed,
            "ok": True, "by_staleness": by or {}, "bound_trace": [[1, 2], [5, 3]]}


def test_summary_groups_seeds_counts_collapses_and_writes_tables_and_plots(tmp_path):
    results = {main_arm("minirl", "none", "k8", s)[0]: result(0.1 * (s + 1), collapsed=s == 2,
                                                              by={"0": {"ess": 0.99, "token_share": 0.5},
                                                                  "8+": {"ess": 0.4, "token_share": 0.5}})
               for s in range(3)}
    results["mismatch:dppo_tv-t1.3"] = result(0.15)
    results["main:minirl-none-auto-s0"] = result(0.2)
    groups = summarise(results)
    g = groups["main:minirl-none-k8"]
    assert g["seeds"] == 3 and g["collapsed"] == 1 and g["heldout_accuracy"]["mean"] == pytest.approx(0.2)
    out = stability_summary(results, tmp_path)
    assert "| minirl-none-k8 | 0.200 ± 0.100 [0.100, 0.300]" in out["table_main"]
    assert "| 1/3 |" in out["table_main"] and "mismatch:dppo_tv-t1.3" in out["table_mismatch"]
    assert "| minirl | 8+ | 0.500 | 0.400 |" in out["table_by_staleness"]
    assert "plots_error" not in out and all((tmp_path / p).stat().st_size > 3000 for p in
                                            ("accuracy_by_bound.png", "mismatch_sweep.png", "auto_bound.png"))
