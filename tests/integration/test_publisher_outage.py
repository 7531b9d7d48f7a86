"""Broker outages while publishing: backpressure, no false successes, every record delivered after;
the dead-letter writer through a hung broker.

Each test runs its own tansu broker (`fresh_broker`) so pausing or stopping
it does not disturb the session broker.
"""
from __future__ import annotations

import threading
import time

import pytest

from rlstream.common import metrics
from rlstream.common.kafka.broker import EmbeddedBroker
from rlstream.common.config import BrokerSettings
from rlstream.common.errors import PublishError
from rlstream.common.kafka.client import ensure_topics
from rlstream.common.kafka.publisher import RolloutPublisher
from rlstream.common.kafka.reader import RolloutReader
from tests.fixtures.kafka import make_kafka_settings, realistic_rollout


def rollouts(n: int, seed0: int, groups: int = 5):
    return [realistic_rollout(response_tokens=64, prompt_tokens=16, layers=4, seed=seed0 + i,
                              group_id=f"g{seed0}-{i % groups}", sample_idx=i // groups, group_size=n // groups + 1)
            for i in range(n)]


def read_everything(kafka, quiet_s: float = 1.5, timeout_s: float = 30.0) -> list:
    """All valid records on the rollouts topic (stops after `quiet_s` without new ones)."""
    out, last, deadline = [], time.monotonic(), time.monotonic() + timeout_s
    with RolloutReader(kafka) as rd:
        while time.monotonic() - last < quiet_s and time.monotonic() < deadline:
            got = rd.poll(max_records=500, timeout_s=0.3)
            if got:
                out += got
                last = time.monotonic()
        assert rd.dlq_total == 0
    return out


def check_delivered(futs, rs, items) -> None:
    """Every record on the topic; every success names a (partition, offset) that holds that record."""
    at = {(it.partition, it.offset): it.rollout.rollout_id for it in items}
    assert {it.rollout.rollout_id for it in items} == {r.rollout_id for r in rs}
    for f in futs:
        d = f.result(timeout=0)
        assert at.get((d.partition, d.offset)) == f.rollout_id, "success reported for a record not at its offset"


@pytest.mark.broker
@pytest.mark.timeout(180)
def test_hung_broker_blocks_publishers_and_everything_arrives_after(fresh_broker, tmp_path):
    """SIGSTOP the broker (sockets open, no answers): the kafka-python delivery timeout fires,
    the publisher replaces its producer and re-sends until the broker is back."""
    kafka = make_kafka_settings(fresh_broker.bootstrap, tmp_path, request_timeout_ms=1000,
                                publish_buffer_records=8, retry_backoff_ms=100)
    rs = rollouts(45, seed0=1000)
    rebuilds0 = metrics.value("rlstream_publisher_rebuilds_total")
    pub = RolloutPublisher(kafka)
    try:
        futs = [pub.publish(r) for r in rs[:5]]
        pub.flush(30)
        fresh_broker.pause()
        t_pause = time.monotonic()

        def produce():
            for r in rs[5:]:
                futs.append(pub.publish(r))

        worker = threading.Thread(target=produce, daemon=True)
        worker.start()
        time.sleep(4.0)  # > 2 delivery timeouts (2 x request_timeout): failures and producer rebuilds happened
        during = futs[5:]
        assert worker.is_alive(), "publish must block (backpressure) while the broker is down"
        assert len(during) == 8 and pub.buffer_depth == 8
        assert not any(f.done() for f in during), "a future completed while the broker was frozen"
        assert pub.try_publish(rs[-1]) is None
        with pytest.raises(PublishError, match="buffer full"):
            pub.publish(rs[-1], timeout=0.2)
        assert metrics.value("rlstream_publisher_rebuilds_total") > rebuilds0
        fresh_broker.resume()
        worker.join(60)
        assert not worker.is_alive()
        pub.flush(60)
        print(f"outage {time.monotonic() - t_pause:.1f} s, retries on records:",
              sorted(f.result().attempts for f in futs)[-5:])
    finally:
        pub.close(10)
    assert len(futs) == 45 and all(f.done() and f.exception() is None for f in futs)
    assert any(f.result().attempts > 1 for f in futs[5:])
    check_delivered(futs, rs, read_everything(kafka))


@pytest.mark.broker
@pytest.mark.timeout(180)
def test_broker_restart_records_published_while_down_arrive(tmp_path):
    """Stop the broker (connection refused), publish, start a new one on the same port.

    tansu's storage is memory: records acknowledged before the stop are gone
    with the process; records published while it was down must all arrive,
    and none of their futures may succeed before the new broker is up.
    """
    b = EmbeddedBroker(BrokerSettings(port=0)).start()
    port = b.port
    try:
        kafka = make_kafka_settings(b.bootstrap, tmp_path, request_timeout_ms=1000,
                                    publish_buffer_records=64, retry_backoff_ms=100)
        rs = rollouts(20, seed0=2000)
        with RolloutPublisher(kafka) as pub:
            pub.publish(rs[0]).result(10)
            b.stop()
            futs = [pub.publish(r, timeout=5) for r in rs[1:]]
            time.sleep(3.0)
            assert not any(f.done() for f in futs), "a future completed while no broker was running"
            b = EmbeddedBroker(BrokerSettings(port=port)).start()
            t_up = time.monotonic()
            ensure_topics(kafka)
            for f in futs:
                f.result(timeout=60)
            print(f"delivered {len(futs)} records {time.monotonic() - t_up:.1f} s after restart")
        check_delivered(futs, rs[1:], read_everything(kafka))
    finally:
        b.stop()


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_dead_letter_writer_fails_loudly_while_the_broker_hangs_and_recovers_with_a_new_producer(
        fresh_broker, tmp_path):
    """confirm() raises BrokerError (never a false success) while the broker is frozen; the writer drops
    its producer, and after SIGCONT the caller's re-send goes through a fresh one."""
    from types import SimpleNamespace

    from rlstream.common.errors import BrokerError
    from rlstream.common.kafka.dlq import H_SOURCE, DeadLetterWriter

    kafka = make_kafka_settings(fresh_broker.bootstrap, tmp_path, request_timeout_ms=1000, retry_backoff_ms=100)

    def refused(offset):
        return SimpleNamespace(topic="src", partition=0, offset=offset, key=b"k", value=b"v%d" % offset,
                               headers=None)
    w = DeadLetterWriter(kafka)
    try:
        w.send(refused(1), "key", "bad key")
        assert w.confirm() == 1
        first = w._producer
        fresh_broker.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(BrokerError, match=kafka.topics.dlq):
                w.send(refused(2), "key", "bad key")
                w.confirm()
            assert time.monotonic() - t0 < 20
            assert w._producer is None
        finally:
            fresh_broker.resume()
        w.send(refused(2), "key", "bad key")  # the caller re-reads the record and sends it again
        assert w.confirm() == 1 and w._producer is not first
    finally:
        w.close()
    from rlstream.common.kafka.client import make_consumer
    from kafka import TopicPartition

    c = make_consumer(kafka, auto_offset_reset="earliest")
    c.assign([TopicPartition(kafka.topics.dlq, 0)])
    got, deadline = [], time.monotonic() + 20
    while {b"v1", b"v2"} - {m.value for m in got} and time.monotonic() < deadline:
        got += [m for batch in c.poll(timeout_ms=300).values() for m in batch]
    c.close()
    sources = [dict(m.headers)[H_SOURCE] for m in got]
    assert {b"src/0/1", b"src/0/2"} <= set(sources) and set(sources) <= {b"src/0/1", b"src/0/2"}
