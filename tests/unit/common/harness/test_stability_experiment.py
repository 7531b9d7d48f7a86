"""The stability experiment's arms, its spreads over seeds, tables and plots (ops/harness/stability.py),
from hand-made per-arm results."""
from __future__ import annotations

import pytest

import json

from rlstream.harness.stability import (
    arm_specs,
    arms_from_run_dirs,
    main,
    main_arm,
    spread,
    stability_summary,
    summarise,
)


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


def run_dir(root, arm, stamp, versions=None, error=None, ess=0.9):
    """A run directory as rlstream.harness.runs.run_rl leaves it (summary.json absent: cut off)."""
    d = root / f"stability-{arm}-{stamp}"
    d.mkdir()
    rows = [{"kind": "eval", "time": 0.0, "version": 0, "heldout_accuracy": 0.09}]
    rows += [{"kind": "tick", "time": 5.0 * i, "version": i, "ess": ess, "max_staleness": 2.0, "kl": 1e-3}
             for i in range(1, 5)]
    (d / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if versions is not None:
        (d / "summary.json").write_text(json.dumps(
            {"label": f"stability-{arm}", "run_dir": str(d), "warm_accuracy": 0.09, "final_accuracy": 0.12,
             "best_accuracy": 0.12, "reached_target": False, "seconds_to_target": None, "rl_seconds": 20.0,
             "startup_seconds": 9.0, "versions": versions, "samples_per_s": 50.0 if versions else 0.0,
             "exit_codes": {"consumer": 0}, "accounting": {"ok": True}, "error": error}))


def test_arms_rebuilt_from_run_directories_of_a_cut_off_run(tmp_path):
    """An experiment killed before its JSON: the finished arms come back from their run directories
    (the newest finished one per arm), failed, cut-off and never-run arms are listed as missing."""
    run_dir(tmp_path, "main:minirl-none-k0-s0", "20261127-194214", versions=124, ess=0.5)
    run_dir(tmp_path, "main:minirl-none-k0-s0", "20261127-204214", versions=120, ess=0.8)  # newer: counts
    run_dir(tmp_path, "main:minirl-none-k2-s1", "20261127-202743", versions=0,
            error="timed out after 240 s waiting for producer-0 to be healthy\n--- broker ...")
    run_dir(tmp_path, "main:minirl-R3-k2-s1", "20261127-205210")
    arms, missing = arms_from_run_dirs(tmp_path)
    assert list(arms) == ["main:minirl-none-k0-s0"]
    m = arms["main:minirl-none-k0-s0"]
    assert m["heldout_accuracy"] == 0.12 and m["versions"] == 120 and m["ess"] == pytest.approx(0.8)
    assert m["ok"] and m["bound_final"] == 2.0
    assert missing["main:minirl-none-k2-s1"] == "failed: timed out after 240 s waiting for producer-0 to be healthy"
    assert missing["main:minirl-R3-k2-s1"].startswith("cut off: no summary.json")
    assert missing["mismatch:dppo_kl-t1.6"] == "not run" and len(missing) == len(arm_specs()) - 1

    out = tmp_path / "out"
    assert main(["--run-dirs", str(tmp_path), "--out", str(out)]) == 0
    tables = (out / "tables.md").read_text()
    assert "| minirl-none-k0 | 0.120 |" in tables and "| main:minirl-R3-k2-s1 | cut off" in tables
    res = json.loads((out / "arms.json").read_text().strip().splitlines()[-1])
    assert res["warm_accuracy"] == 0.09 and list(res["arms"]) == ["main:minirl-none-k0-s0"]
    assert res["arm_versions"] == 120 and "main:minirl-none-k2-s1" in res["missing"]
    assert not (out / "mismatch_sweep.png").exists() and (out / "auto_bound.png").exists()
