"""`rlstream blobs gc` against the real broker: it never deletes a blob that a retained
record, a dead letter or (with --keep-from-checkpoints) a checkpoint still points to.

Claim-checked groups go on the rollouts topic, a claim-check pointer sits in
the DLQ, and the store also holds an orphan blob (its producer died before the
pointer was acknowledged), a young orphan and a crashed put's temporary file;
every file is made older than the age grace except the young orphan. The
default collection deletes only the old orphan and the temporary file. With a
consumer checkpoint whose offsets lie between the groups, the blobs of the
groups below it go too, and every record at or above its offsets still
resolves.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import numpy as np
import pytest
import yaml

from rlstream.common.config import RlstreamConfig
from rlstream.common.kafka.claimcheck import BlobStore, resolve
from rlstream.common.errors import InvalidRecordError
from rlstream.common.kafka.publisher import RolloutPublisher
from rlstream.common.kafka.scan import TopicScan
from rlstream.common.record import ClaimPointer, encode_claim_pointer
from tests.fixtures.kafka import make_kafka_settings
from tests.support.synthetic import synthetic_group

pytestmark = [pytest.mark.broker]


def _age(store: BlobStore, keep_young: set[str]) -> None:
    old = time.time() - 7200
    for b in store.blobs():
        if b.name not in keep_young:
            os.utime(b.path, (old, old))


def _gc(path, capsys, *extra: str) -> dict:
    from rlstream.cli import main

    capsys.readouterr()
    assert main(["blobs", "gc", "-c", str(path), "--min-age-s", "3600", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_gc_keeps_what_retained_records_and_checkpoints_point_to(broker, tmp_path, capsys):
    from rlstream.common.kafka.client import make_producer
    from rlstream.consumer.checkpoint.files import CheckpointState

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=1, claim_check_bytes=2048)
    store = BlobStore(kafka.blob_dir)
    rng = np.random.default_rng(2)
    offsets = []  # per group: its first offset
    with RolloutPublisher(kafka) as pub:
        for i in range(4):
            deliveries = [pub.publish(r, timeout=30).result(timeout=60) for r in synthetic_group(f"g{i}", 2, 0, rng,
                                                                                                 prompt_len=300)]
            assert all(d.claim_check for d in deliveries)
            offsets.append(min(d.offset for d in deliveries))
        dlq_uri, dlq_sha, n = store.put(b"a dead letter's blob")
        p = make_producer(kafka, "dlq")
        p.send(kafka.topics.dlq, key=b"k", value=encode_claim_pointer(ClaimPointer("r", "g", dlq_uri, dlq_sha, n)))
        p.flush(30)
        p.close()
    _, orphan, _ = store.put(b"stored, its pointer never acknowledged")
    _, young, _ = store.put(b"stored a moment ago")
    (tmp_path / "blobs" / orphan[:2] / f".{orphan[:16]}.x.tmp").write_bytes(b"torn")
    _age(store, {young})
    before = {b.name for b in store.blobs() if not b.temporary}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(RlstreamConfig.model_validate({"kafka": kafka.model_dump()}).model_dump(mode="json")))

    dry = _gc(path, capsys, "--report-only")
    assert dry["deleted"] == 1 and {b.name for b in store.blobs() if not b.temporary} == before
    report = _gc(path, capsys)
    assert (report["deleted"], report["temporaries_deleted"], report["kept_young"]) == (1, 1, 1), report
    after = {b.name for b in store.blobs()}
    assert after == before - {orphan}  # every pointed-to blob, the DLQ's included, and the young one stay

    ckpt = tmp_path / "ckpt" / "step-00000003"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps(asdict(CheckpointState(3, 3, {0: offsets[2]}))))
    report = _gc(path, capsys, "--keep-from-checkpoints", str(tmp_path / "ckpt"))
    assert report["deleted"] == 4, report  # the blobs of the two groups below the checkpoint
    resolved = {}
    with TopicScan(kafka, kafka.topics.rollouts) as scan:
        while not scan.done(0):
            for m in scan.poll():
                try:
                    resolved[m.offset] = resolve(m.value, store)[0] is not None
                except InvalidRecordError as e:
                    assert e.field == "claim_check", e
                    resolved[m.offset] = False
    assert resolved == {o: o >= offsets[2] for o in resolved} and len(resolved) == 8
    assert dlq_sha in {b.name for b in store.blobs()}
