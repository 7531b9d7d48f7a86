"""Test-only topic access: raw writes (no validation at all), the weights announced, the
rollouts as the consumer's reader takes them, and a trainer's start announced by hand.

Reading whole topics back (read_topic, read_dlq, read_rollouts) is the
harness's: ops/harness/census.py.
"""
from __future__ import annotations

from rlstream.common.config import KafkaSettings
from rlstream.harness.census import read_topic


def latest_policy(kafka: KafkaSettings):
    """The newest WeightsReady on the policy topic (None if none)."""
    announced = weights_announcements(kafka)
    return max(announced, key=lambda a: a.version) if announced else None


def weights_announcements(kafka: KafkaSettings) -> list:
    """Every WeightsReady on the policy topic, in log order."""
    from rlstream.common.control.messages import WeightsReady, parse_policy_message

    out = []
    for m in read_topic(kafka, kafka.topics.policy, quiet_s=0.8):
        try:
            a = parse_policy_message(m.value)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(a, WeightsReady):
            out.append(a)
    return out


def announced_versions(announcements: list) -> list[int]:
    """The versions in the order they were first announced. A version may be announced
    again only for the same weights (the durable copy written later: the same digest);
    a version number given to other weights fails here."""
    weights: dict[int, str | None] = {}
    order = []
    for a in announcements:
        w = a.digest or a.sha256
        if a.version in weights:
            assert weights[a.version] == w, f"version {a.version} announced for other weights"
        else:
            weights[a.version] = w
            order.append(a.version)
    return order


def send_raw(kafka: KafkaSettings, topic: str, key: bytes | None, value: bytes) -> None:
    """One message, acknowledged (acks=all), no validation at all."""
    from kafka import KafkaProducer

    from rlstream.common.kafka.client import client_kwargs

    p = KafkaProducer(**client_kwargs(kafka), acks="all", max_request_size=kafka.max_message_bytes)
    try:
        p.send(topic, key=key, value=value).get(timeout=30)
    finally:
        p.close(timeout=10)


def append_batches(bootstrap: str, topic: str, partition: int, n: int, value: bytes = b"x" * 64,
                   timeout_s: float = 120.0) -> None:
    """Append `n` one-record batches to `topic`/`partition`: n ProduceRequests (acks=1) written
    back to back on one connection, then their n answers read. A partition the length of hours
    of a pipeline's traffic in seconds (a client producer sends a few thousand requests a second:
    tansu stores one batch per produce request, and its fetch time grows with their number)."""
    import socket
    import struct

    from kafka.protocol.producer.produce import ProduceRequest
    from kafka.record.memory_records import MemoryRecordsBuilder

    from rlstream.common.kafka.broker import recv_exact

    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
    builder.append(0, None, value, [])
    builder.close()
    data = ProduceRequest.TopicProduceData(name=topic, partition_data=[
        ProduceRequest.TopicProduceData.PartitionProduceData(index=partition, records=builder.buffer())])
    request = ProduceRequest(transactional_id=None, acks=1, timeout_ms=30_000, topic_data=[data], version=3)
    request.with_header(correlation_id=0, client_id="rlstream-test")
    template = bytearray(request.encode(header=True, framed=True))
    host, port = bootstrap.split(",")[0].strip().rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        for i in range(0, n, 1000):
            chunk = range(i, min(n, i + 1000))
            out = bytearray()
            for j in chunk:  # framed: size, api key, api version, then the correlation id
                struct.pack_into(">i", template, 8, j)
                out += template
            s.sendall(out)
            for _ in chunk:  # the answers of this thousand before the next
                (size,) = struct.unpack(">i", recv_exact(s, 4))
                recv_exact(s, size)


def read_valid_rollouts(kafka: KafkaSettings, timeout_s: float = 2.0) -> list:
    """The rollouts the consumer's reader takes (valid ones, in log order, duplicates kept),
    until two polls of timeout_s / 2 bring nothing."""
    from rlstream.common.kafka.reader import RolloutReader

    with RolloutReader(kafka) as r:
        out, idle = [], 0
        while idle < 2:
            items = r.poll(max_records=1000, timeout_s=timeout_s / 2)
            idle = 0 if items else idle + 1
            out.extend(items)
    return [it.rollout for it in out]


def announce_trainer_start(kafka: KafkaSettings, groups_per_batch: int, group_size: int) -> None:
    """What a consumer says when it starts: version 0, nothing read yet, its batch shape. The
    producers' backpressure needs groups_per_batch; for tests that run no trainer."""
    from kafka import KafkaProducer

    from rlstream.common.control.messages import TrainerProgress
    from rlstream.common.kafka.client import client_kwargs

    msg = TrainerProgress(trainer_version=0, groups_per_batch=groups_per_batch, group_size=group_size)
    p = KafkaProducer(**client_kwargs(kafka), acks="all")
    p.send(kafka.topics.policy, key=msg.kind.encode(), value=msg.model_dump_json().encode()).get(timeout=10)
    p.close()
