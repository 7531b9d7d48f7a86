"""`rlstream export`: a rollouts topic on the real broker to Parquet, read back with `datasets`.

Records of every kind go on the topic: single-turn with routing, a multi-turn
(schema 2) record with environment tokens and several token versions,
claim-checked records (resolved from the blob store) and one undecodable
record. The export runs in two parts (a first run stops after a few records
with tiny row groups and parts; a second run, through the command, continues
from the directory's cursor), and again through a consumer group into two
fresh directories. `datasets.load_dataset("parquet", ...)` reads the parts:
every record is there once, every array and scalar equal to the record's.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlstream.common.config import RlstreamConfig
from rlstream.common.kafka.publisher import RolloutPublisher
from tests.fixtures.kafka import make_kafka_settings, realistic_rollout
from tests.support.synthetic import publish_groups, synthetic_group

pytestmark = [pytest.mark.broker]


def _multi_turn(seed: int):
    r = realistic_rollout(response_tokens=40, prompt_tokens=12, layers=2, top_k=2, num_experts=8, vocab=64,
                          group_id=f"mt-{seed}", group_size=1, seed=seed)
    mask = np.ones(40, dtype=bool)
    mask[15:25] = False  # an environment turn
    r.loss_mask = mask
    r.logprobs = np.where(mask, r.logprobs, 0).astype(np.float32)
    return r


@pytest.fixture(scope="module")
def topic(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2, claim_check_bytes=2048)
    rng = np.random.default_rng(5)
    groups = [synthetic_group(f"g{i}", 4, i, rng, prompt_len=300 if i % 3 == 0 else 5,
                              routing=i != 4) for i in range(6)]
    groups += [[_multi_turn(1)], [_multi_turn(2)]]
    with RolloutPublisher(kafka) as pub:
        publish_groups(pub, groups)
        pub.publish_bytes(b"bad", b"\x92\x01\x02", timeout=30).result(timeout=30)
    records = {r.rollout_id: r for g in groups for r in g}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(RlstreamConfig.model_validate({"kafka": kafka.model_dump()}).model_dump(mode="json")))
    return kafka, records, path, tmp


def _cli(argv: list[str], capsys) -> dict:
    from rlstream.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _rows(*dirs: Path) -> list[dict]:
    from datasets import load_dataset

    files = sorted(str(f) for d in dirs for f in Path(d).glob("part-*.parquet"))
    return list(load_dataset("parquet", data_files=files, split="train"))


def _check_row(row: dict, r) -> None:
    for k in ("group_id", "sample_idx", "group_size", "producer_id", "created_at", "policy_version", "reward",
              "finish_reason", "temperature", "prompt_text", "sampling_digest", "model_digest", "num_experts"):
        assert row[k] == getattr(r, k), k
    for k, dt in (("prompt_ids", np.int32), ("response_ids", np.int32), ("logprobs", np.float32)):
        assert np.array_equal(np.asarray(row[k], dtype=dt), getattr(r, k)), k
    assert np.array_equal(np.asarray(row["loss_mask"], dtype=bool), r.model_mask)
    assert row["record_schema"] == (1 if r.loss_mask is None else 2)
    versions = np.asarray(row["token_versions"])
    if r.token_versions is None:
        assert (versions == r.policy_version).all() and len(versions) == r.num_tokens
    else:
        assert np.array_equal(versions, np.repeat(r.token_versions[:, 0], r.token_versions[:, 1]))
    if r.routed_experts is None:
        assert row["routed_experts"] is None and row["routing_shape"] is None
    else:
        routed = np.frombuffer(row["routed_experts"], row["routing_dtype"]).reshape(row["routing_shape"])
        assert np.array_equal(routed, r.routed_experts) and row["routing_scope"] == r.routing_scope
    assert json.loads(row["reward_info"]) == r.reward_info if r.reward_info else row["reward_info"] is None


@pytest.mark.timeout(300)
def test_export_resumes_and_datasets_reads_every_record(topic, capsys):
    from rlstream.common.export.run import ExportOptions, export

    kafka, records, path, tmp = topic
    out = tmp / "out"
    first = export(kafka, out, ExportOptions(max_records=7, row_group_bytes=1500, part_bytes=4000))
    assert first.records + first.rejected == 7 and first.parts >= 2  # small parts: it rolled over
    second = _cli(["export", "-c", str(path), "--out", str(out)], capsys)
    assert first.records + second["records"] == len(records)
    assert first.rejected + second["rejected"] == 1
    rejects = [json.loads(x) for x in (out / "_rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1 and "invalid record" in rejects[0]["reason"]

    rows = _rows(out)
    assert sorted(r["rollout_id"] for r in rows) == sorted(records)  # each once: no gap, no duplicate
    for row in rows:
        _check_row(row, records[row["rollout_id"]])
    claimed = [row for row in rows if row["claim_check"]]
    assert claimed and all(len(row["claim_check"]) == 64 for row in claimed)
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(sorted(out.glob("part-*.parquet"))[0]).schema_arrow.metadata
    assert meta[b"rlstream.export_schema"] == b"1" and meta[b"rlstream.topic"] == kafka.topics.rollouts.encode()
    again = _cli(["export", "-c", str(path), "--out", str(out)], capsys)  # nothing new: nothing written
    assert again["records"] == 0 and len(_rows(out)) == len(records)


@pytest.mark.timeout(300)
def test_export_follows_a_consumer_group(topic, capsys):
    kafka, records, path, tmp = topic
    a = _cli(["export", "-c", str(path), "--out", str(tmp / "ga"), "--group", "exp", "--max-records", "9"], capsys)
    b = _cli(["export", "-c", str(path), "--out", str(tmp / "gb"), "--group", "exp"], capsys)
    assert a["records"] + a["rejected"] == 9 and a["records"] + b["records"] == len(records)
    assert sorted(r["rollout_id"] for r in _rows(tmp / "ga", tmp / "gb")) == sorted(records)
