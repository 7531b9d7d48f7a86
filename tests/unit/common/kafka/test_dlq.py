"""The dead-letter writer's contract with a fake producer: headers, confirm-before-advance, rebuild after a
failure. tests/integration/test_kafka_roundtrip.py and test_publisher_outage.py run it against the real broker."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError
from rlstream.common.kafka import dlq
from rlstream.common.kafka.dlq import H_FIELD, H_REASON, H_SOURCE, DeadLetterWriter, dead_letter_headers


@dataclass
class Msg:
    topic: str = "rlstream.rollouts"
    partition: int = 2
    offset: int = 41
    key: bytes | None = b"g1"
    value: bytes | None = b"\x00junk"
    headers: list | None = None


class Future:
    def __init__(self, error: Exception | None = None):
        self.error = error
        self.waited = False

    def get(self, timeout):
        self.waited = True
        if self.error:
            raise self.error


class FakeProducer:
    def __init__(self, fail_with: Exception | None = None):
        self.sent, self.futures, self.closed = [], [], False
        self.fail_with = fail_with

    def send(self, topic, key, value, headers):
        self.sent.append((topic, key, value, headers))
        self.futures.append(Future(self.fail_with))
        return self.futures[-1]

    def close(self, timeout):
        self.closed = True


@pytest.fixture
def producers(monkeypatch):
    """Every producer the writer builds, in order; set `plan` to make the next ones fail."""
    built: list[FakeProducer] = []
    plan: list[Exception | None] = []

    def make(kafka, role, **overrides):
        assert role == "dlq" and not overrides
        built.append(FakeProducer(plan.pop(0) if plan else None))
        return built[-1]
    monkeypatch.setattr(dlq, "make_producer", make)
    return built, plan


KAFKA = KafkaSettings(bootstrap_servers="a:1")


def test_headers_keep_the_originals_and_say_why():
    m = Msg(headers=[("trace", b"abc")])
    h = dead_letter_headers(m, "logprobs", "must be <= 0 " + "x" * 5000)
    assert h[0] == ("trace", b"abc")
    assert dict(h[1:]) == {H_REASON: (b"must be <= 0 " + b"x" * 5000)[:4000], H_FIELD: b"logprobs",
                           H_SOURCE: b"rlstream.rollouts/2/41"}


def test_confirm_waits_for_every_letter_sent_since_the_last_confirm(producers):
    built, _ = producers
    w = DeadLetterWriter(KAFKA)
    assert built == [], "the producer is built on the first dead letter"
    w.send(Msg(offset=1), "key", "bad key")
    w.send(Msg(offset=2, value=None), "<bytes>", "empty")
    (p,) = built
    dlq_topic = KAFKA.topics.dlq
    assert [(t, k, v) for t, k, v, _ in p.sent] == [(dlq_topic, b"g1", b"\x00junk"), (dlq_topic, b"g1", b"")]
    assert not any(f.waited for f in p.futures)
    assert w.confirm() == 2 and all(f.waited for f in p.futures)
    assert w.confirm() == 0
    w.close()
    assert p.closed


def test_a_failed_confirmation_forgets_the_letters_and_rebuilds_the_producer(producers):
    built, plan = producers
    plan.append(TimeoutError("delivery timed out"))
    w = DeadLetterWriter(KAFKA)
    w.send(Msg(offset=1), "key", "bad key")
    with pytest.raises(BrokerError, match=f"{KAFKA.topics.dlq}.*TimeoutError"):
        w.confirm()
    assert built[0].closed
    assert w.confirm() == 0, "the failed letters are the caller's to re-send, not the writer's"
    w.send(Msg(offset=1), "key", "bad key")  # the caller re-reads and re-sends
    assert len(built) == 2 and w.confirm() == 1


def test_a_failed_send_is_a_broker_error_and_the_next_send_retries(producers, monkeypatch):
    built, _ = producers
    w = DeadLetterWriter(KAFKA)
    w.send(Msg(offset=1), "key", "bad key")

    def broken_send(*a, **kw):
        raise RuntimeError("producer closed")
    monkeypatch.setattr(built[0], "send", broken_send)
    with pytest.raises(BrokerError, match="producer closed"):
        w.send(Msg(offset=2), "key", "bad key")
    assert built[0].closed and w.confirm() == 0
    w.send(Msg(offset=2), "key", "bad key")
    assert len(built) == 2 and w.confirm() == 1
