"""The journal is input like any topic: hostile records through the real broker to a running
journaling producer (the session's vLLM engine and broker).

Written straight to the journal topic by a plain Kafka client: a key that is not UTF-8,
leases that are not JSON or have the wrong shape, malformed entries, an entry under
another episode's key, and orphaned entries (their holder never had a lease) that are
well formed but would make a record the schema refuses or the engine cannot take: a
4-million-token prompt, a prompt id of -5 and one past the vocabulary, NaN log-probs, a
300-character rollout_id, a sample index past its group, routing of another model's
shape. Among them one valid orphan. The producer reads them all at start and on every
claim pass: it keeps running, every hostile record is counted by reason
(`rlstream_producer_journal_refused_total`), each refused orphan is in the DLQ with the
reason header and tombstoned, and the valid orphan is resumed and published (claim epoch 1).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest

from rlstream.common import metrics
from tests.fixtures.kafka import make_kafka_settings
from tests.support.journaled_episodes import CLIENTS, G, Turns, config
from tests.support.topics import announce_trainer_start, read_valid_rollouts

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]
REASONS = ("key", "lease", "entry", "key_mismatch", "limits")


def orphans(prompt: np.ndarray, vocab: int) -> tuple[object, dict[str, object]]:
    """The valid orphan and the hostile ones (name -> Snapshot), all held by a producer that never lived."""
    from rlstream.producer.journal.snapshot import Snapshot

    def entry(i: int, **kw) -> Snapshot:
        base = dict(group_id="dead-x-1", sample_idx=i, group_size=8, owner="dead", holder="dead", incarnation="gone",
                    rollout_id=f"r{i:031d}", written_at=time.time() - 3600, prompt_text="1+2=", answer="3",
                    own_score=False, prompt_ids=prompt, response=np.zeros(0, np.int32), mask=np.zeros(0, bool),
                    logprobs=np.zeros(0, np.float32), versions=np.zeros(0, np.int64), routing=None, num_experts=0,
                    turns=0, reward=0.0)
        return Snapshot(**{**base, **kw})

    one = dict(response=np.array([5], np.int32), mask=np.ones(1, bool), versions=np.zeros(1, np.int64), turns=1)
    hostile = {
        "4M-token prompt": entry(1, prompt_ids=np.ones(4_000_000, np.int32)),
        "prompt id -5": entry(2, prompt_ids=np.r_[prompt, -5].astype(np.int32)),
        "prompt id past the vocabulary": entry(3, prompt_ids=np.r_[prompt, vocab].astype(np.int32)),
        "NaN log-probs": entry(4, logprobs=np.array([math.nan], np.float32), **one),
        "300-character rollout_id": entry(5, rollout_id="r" * 300),
        "sample past its group": entry(8),
        "routing of another model": entry(7, routing=np.zeros((len(prompt), 3, 2), np.uint8), num_experts=4,
                                          logprobs=np.zeros(1, np.float32), **one),
    }
    return entry(0), hostile


def writer(kafka):
    """write(records): straight to the journal topic, as any Kafka client can."""
    from kafka import KafkaProducer

    from rlstream.common.kafka.client import client_kwargs
    from rlstream.producer.journal.topic import ensure_journal_topic

    journal = ensure_journal_topic(kafka)
    raw = KafkaProducer(**client_kwargs(kafka), acks="all", max_request_size=kafka.max_message_bytes)

    def write(records: list[tuple[bytes, bytes]]) -> None:
        for k, value in records:
            raw.send(journal, key=k, value=value)
        raw.flush(timeout=60)

    return journal, write, raw


def settle(b, invalid0: float, hostile: int) -> None:
    """Step b until every hostile orphan is refused and the valid one published; then a few claim
    passes more (nothing is claimed again) and a read of the journal past them."""
    count = lambda: metrics.value("rlstream_producer_resumed_episodes_total", outcome="invalid") or 0  # noqa: E731
    deadline = time.monotonic() + 120
    while count() - invalid0 < hostile or b.driver.has_work() or b.outbox.unacked_records:
        assert time.monotonic() < deadline, "the orphans were not all refused or resumed"
        b.iterate()
    b.outbox.drain(timeout_s=30)
    for _ in range(3):
        b.driver.runner.journal._next_claim = 0.0
        b.iterate()
    b.driver.runner.journal.topic.sync()


@pytest.mark.timeout(300)
def test_hostile_journal_records_are_refused_counted_and_the_producer_keeps_running(
        broker, rollout_engine, tiny_model_dir, tmp_path, monkeypatch):
    from rlstream.common.tasks import envs
    from rlstream.harness.census import read_dlq
    from rlstream.common.lifecycle import close_attrs
    from rlstream.toy.build import ensure_data
    from rlstream.producer.journal.snapshot import encode
    from rlstream.producer.service import ProducerService

    monkeypatch.setitem(envs.ENVIRONMENTS, "calculator", Turns)
    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    data = tmp_path / "data" / "train.jsonl"
    ensure_data(config(kafka, tiny_model_dir, data, "b", True), n_train=16, n_heldout=4)
    announce_trainer_start(kafka, groups_per_batch=2, group_size=G)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    valid, hostile = orphans(rollout_engine.encode("1+2="), vocab)
    journal, write, raw = writer(kafka)
    # read at start: counted and skipped (a history read again at every start is not copied to the DLQ)
    write([(b"lease:ghost", b"not json"), (b"lease:ghost2", b"[1, 2]"),
           (b"lease:ghost3", b'{"incarnation": "i", "at": "soon"}'), (b"ep:g#0", b"junk"),
           *[(s.key.encode(), encode(s)) for s in hostile.values()], (valid.key.encode(), encode(valid))])
    count = lambda name, **kw: metrics.value(name, **kw) or 0  # noqa: E731
    refused0 = {r: count("rlstream_producer_journal_refused_total", reason=r) for r in REASONS}
    invalid0, resumed0 = (count("rlstream_producer_resumed_episodes_total", outcome=o) for o in ("invalid", "resumed"))

    b = ProducerService(config(kafka, tiny_model_dir, data, "b", True), broker.bootstrap)
    b.start(engine=rollout_engine)  # reads every hostile record at start
    b.admit = lambda: None  # b's own groups would only slow this down: it resumes the orphans
    # read while running: counted, skipped and copied to the DLQ (b would claim their keys)
    write([(b"\xff\xfe", b"x"), (b"ep:g#1", b"RJ1\x02\x00\x00\x00{}"),
           (b"ep:dead-x-1#12", encode(dataclasses.replace(valid, sample_idx=9)))])
    raw.close()
    try:
        settle(b, invalid0, len(hostile))
        assert not [k for k, e in b.driver.runner.journal.topic.entries.items() if e.holder == "dead"]  # tombstoned
    finally:
        close_attrs(b, CLIENTS, __import__("logging").getLogger("test"))

    refused = {r: count("rlstream_producer_journal_refused_total", reason=r) - refused0[r] for r in REASONS}
    assert refused == {"key": 1, "lease": 3, "entry": 2, "key_mismatch": 1, "limits": len(hostile)}, refused
    assert count("rlstream_producer_resumed_episodes_total", outcome="invalid") - invalid0 == len(hostile)
    assert count("rlstream_producer_resumed_episodes_total", outcome="resumed") - resumed0 == 1
    (record,) = read_valid_rollouts(kafka)  # the valid orphan, finished by b under its owner's copy and claim epoch
    assert (record.rollout_id, record.producer_id, record.claim_epoch) == (valid.rollout_id, "dead", 1)
    letters = {d.source.rsplit("/", 1)[1]: d for d in read_dlq(kafka, quiet_s=1.0) if d.source.startswith(journal)}
    assert {d.field for d in letters.values()} == {"journal.limits", "journal.key", "journal.entry",
                                                   "journal.key_mismatch"}, letters
    assert [sum(d.field == f"journal.{r}" for d in letters.values()) for r in ("limits", "entry")] == [len(hostile), 1]
    assert all(d.reason for d in letters.values())
