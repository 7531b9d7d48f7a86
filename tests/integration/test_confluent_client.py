"""A second Kafka client against the embedded broker: confluent-kafka 2.16 (librdkafka 2.16).

rlstream's own clients are kafka-python; a third party may well write
rollouts with librdkafka. Against the real tansu broker (the session's, TCP):

- a confluent-kafka Producer (idempotent, acks=all, `partitioner:
  murmur2_random`) publishes one valid group (`rlstream.common.record.encode`, key =
  group id); every record lands on the partition kafka-python's partitioner
  picks for the key (librdkafka's default, CRC32-based `consistent_random`,
  would scatter a group's keys differently from the Python producers');
- the real consumer service (in process, Megatron-core on the tiny model)
  reads that group with its kafka-python reader and trains it;
- a confluent-kafka Consumer (explicit `assign()`, a dummy group.id that is
  never joined) reads the records back byte for byte.

confluent-kafka is an optional test dependency (`pip install -e .[test]`
pins it); without it the module is skipped, saying so. Which clients work and
with which settings: docs/kafka.md "Other clients".
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ck = pytest.importorskip("confluent_kafka", reason="confluent-kafka is not installed (the test extra pins "
                         "confluent-kafka==2.16.0: pip install -e '.[test]')")

pytestmark = [pytest.mark.broker, pytest.mark.megatron]

G = 4


def producer_config(bootstrap: str, max_bytes: int) -> dict:
    """The settings that make librdkafka a well-behaved rollouts producer on tansu (docs/kafka.md)."""
    return {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
            "partitioner": "murmur2_random",  # kafka-python's / Java's key -> partition mapping
            "linger.ms": 2, "message.max.bytes": max_bytes, "delivery.timeout.ms": 60_000,
            "log.connection.close": False}  # tansu closes idle connections: quiet logs


def kafka_python_partition(key: bytes, partitions: int) -> int:
    from kafka.partitioner.default import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % partitions


@pytest.fixture(scope="module")
def service(broker, tiny_model_dir, tmp_path_factory):
    from rlstream.common.config import RlstreamConfig
    from rlstream.consumer.service import ConsumerService
    from tests.fixtures.kafka import make_kafka_settings

    tmp = tmp_path_factory.mktemp("confluent")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=4)
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "producer": {"group_size": G},
        "consumer": {"group_size": G, "groups_per_batch": 1, "checkpoint_dir": str(tmp / "ckpt"),
                     "weight_store_dir": str(tmp / "weights"), "group_timeout_s": 60.0}})
    svc = ConsumerService(cfg, broker.bootstrap)
    svc.start()
    yield svc, kafka
    svc.close()


@pytest.mark.timeout(300)
def test_a_group_produced_with_confluent_kafka_is_trained(service):
    from rlstream.common.record import encode
    from tests.support.synthetic import synthetic_group

    svc, kafka = service
    group = synthetic_group("ck-group", G, svc.version, np.random.default_rng(3))
    p = ck.Producer(producer_config(kafka.bootstrap_servers, kafka.max_message_bytes))
    delivered = []
    for r in group:
        p.produce(kafka.topics.rollouts, key=r.group_id.encode(), value=encode(r),
                  on_delivery=lambda err, m: delivered.append((err, m.partition(), m.offset())))
    assert p.flush(60) == 0
    assert len(delivered) == G and all(err is None for err, _, _ in delivered), delivered
    want = kafka_python_partition(b"ck-group", kafka.topics.rollouts_partitions)
    assert {part for _, part, _ in delivered} == {want}, "librdkafka put the group elsewhere than kafka-python"

    trained_before = svc.ledger.counters["trained"]
    batch = svc.next_batch()
    assert [rg.group.group_id for rg in batch] == ["ck-group"]
    assert sorted(r.rollout_id for r in batch[0].group.rollouts()) == sorted(r.rollout_id for r in group)
    metrics = svc.train_step(batch)
    svc.checkpoint()
    assert np.isfinite(metrics["loss"]) and svc.ledger.counters["trained"] - trained_before == G
    audit = (Path(svc.ccfg.checkpoint_dir) / "trained.jsonl").read_text()
    assert all(r.rollout_id in audit for r in group)


@pytest.mark.timeout(120)
def test_confluent_kafka_reads_the_records_back(service):
    """Explicit assign() at offset 0; librdkafka requires a group.id even then (never joined here)."""
    from rlstream.common.record import decode

    svc, kafka = service
    part = kafka_python_partition(b"ck-group", kafka.topics.rollouts_partitions)
    c = ck.Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "rlstream-unused",
                     "enable.auto.commit": False, "enable.auto.offset.store": False, "fetch.wait.max.ms": 100,
                     "log.connection.close": False})
    try:
        c.assign([ck.TopicPartition(kafka.topics.rollouts, part, 0)])
        got = []
        for _ in range(100):
            got += [m for m in c.consume(64, 0.2) if m.error() is None]
            if len(got) >= G:
                break
    finally:
        c.close()
    records = [decode(m.value()) for m in got]
    assert [m.key() for m in got] == [b"ck-group"] * G and {r.group_id for r in records} == {"ck-group"}
