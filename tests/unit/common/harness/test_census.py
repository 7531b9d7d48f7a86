"""Pure pieces of the demo: record accounting, the report, SFT batches."""
from __future__ import annotations

import json

from common.harness.demo import TopicCensus, account
from common.harness.report import write_report


def _metrics(**outcomes) -> dict:
    return {("rlstream_consumer_records_total", (("outcome", k),)): float(v) for k, v in outcomes.items()}


def test_account_balances_with_whole_held_groups():
    m = _metrics(trained=640, dropped_stale=16, timed_out=8, dlq=1)
    a = account(TopicCensus(681, 681, 681), m, group_size=8, groups_per_batch=4)
    assert a["held"] == 16 and a["ok"], a


def test_account_fails_on_lost_or_partial_records():
    m = _metrics(trained=640)
    assert not account(TopicCensus(650, 650, 650), m, 8, 4)["ok"]   # 10: not whole groups
    assert not account(TopicCensus(680, 680, 680), m, 8, 4)["ok"]   # 40 >= B*G = 32
    assert not account(TopicCensus(630, 630, 630), m, 8, 4)["ok"]   # counted more than published
    assert not account(None, m, 8, 4)["ok"]


def test_account_exact_with_held_gauge():
    m = _metrics(trained=640)
    m[("rlstream_consumer_held_records", ())] = 8.0
    assert account(TopicCensus(648, 648, 648), m, 8, 4)["ok"]
    assert not account(TopicCensus(656, 656, 656), m, 8, 4)["ok"]


def test_report_writes_markdown_and_pngs(tmp_path):
    rows = [{"kind": "eval", "time": 0, "version": 0, "heldout_accuracy": 0.1, "heldout_greedy": 0.2, "metric": "avg@8"}]
    for v in range(1, 20):
        rows.append({"kind": "tick", "time": v * 5.0, "version": v * 3, "reward_mean": 0.1 + v / 100, "kl": 1e-3,
                     "staleness_mean": 1.0, "samples_per_s": 300.0, "clip_frac": 0.0})
        if v % 5 == 0:
            rows.append({"kind": "eval", "time": v * 5.0, "version": v * 3, "heldout_accuracy": 0.1 + v / 50,
                         "heldout_greedy": 0.2 + v / 60, "metric": "avg@8"})
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report(progress, tmp_path / "report", {"warm_accuracy": 0.1, "target_accuracy": 0.25,
                                                       "accounting": {"published": 8, "trained": 8, "ok": True}})
    text = md.read_text()
    for stem in ("reward", "heldout_accuracy", "kl", "staleness", "samples_per_s", "overview"):
        assert (tmp_path / "report" / f"{stem}.png").stat().st_size > 5000
        assert f"({stem}.png)" in text
    assert "| 8 | 8 |" in text


def test_sft_batches_mask_the_prompt():
    from common.harness.sft import _collate

    x, mask, labels = _collate([([5, 6, 7, 1], 2), ([5, 6, 1], 2)], pad_id=0)
    assert x.tolist() == [[5, 6, 7, 1], [5, 6, 1, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[-100, -100, 7, 1], [-100, -100, 1, -100]]
