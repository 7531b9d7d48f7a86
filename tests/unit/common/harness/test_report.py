"""The run report (ops/harness/report.py): markdown and plots from progress rows."""
from __future__ import annotations

import json

from rlstream.harness.report import write_report


def test_report_writes_markdown_and_pngs(tmp_path):
    rows = [{"kind": "eval", "time": 0, "version": 0, "heldout_accuracy": 0.1, "heldout_greedy": 0.2, "metric": "avg@8"}]
    for v in range(1, 20):
        rows.append({"kind": "tick", "time": v * 5.0, "version": v * 3, "reward_mean": 0.1 + v / 100, "kl": 1e-3,
                     "staleness_mean": 1.0, "samples_per_s": 300.0, "clip_frac": 0.0, "ess": 0.9 - v / 100,
                     "mismatch_kl": 1e-4, "grad_norm": 0.5, "max_staleness": 2 + v // 10,
                     "by_staleness": {"0": {"ess": 0.99, "kl": 1e-4, "clip_frac": 0.0, "token_share": 0.4},
                                      "2": {"ess": 0.5 + v / 100, "kl": 0.02, "clip_frac": 0.1, "token_share": 0.6}}})
        if v % 5 == 0:
            rows.append({"kind": "eval", "time": v * 5.0, "version": v * 3, "heldout_accuracy": 0.1 + v / 50,
                         "heldout_greedy": 0.2 + v / 60, "metric": "avg@8"})
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report(progress, tmp_path / "report", {"warm_accuracy": 0.1, "target_accuracy": 0.25,
                                                       "accounting": {"published": 8, "trained": 8, "ok": True}})
    text = md.read_text()
    for stem in ("reward", "heldout_accuracy", "kl", "staleness", "samples_per_s", "ess", "mismatch_kl", "grad_norm",
                 "max_staleness", "overview"):
        assert (tmp_path / "report" / f"{stem}.png").stat().st_size > 5000
        assert f"({stem}.png)" in text
    assert "| 8 | 8 |" in text
    # the signals by staleness, averaged over the second half of the ticks (v = 10..19: ESS 0.6 .. 0.69)
    assert "| 0 | 0.4 | 0.99 | 0.0001 | 0 | - |" in text
    assert "| 2 | 0.6 | 0.645 | 0.02 | 0.1 | - |" in text
