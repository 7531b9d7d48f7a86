"""The driver layer: every kafka-python client rlstream uses is built here.

Nothing else in `common/`, `producer/` or `consumer/` constructs a
KafkaProducer, KafkaConsumer or KafkaAdminClient (tests/integration/
test_security.py checks it), so connection and security settings cannot be
dropped on the way to one client:

- `client_kwargs(kafka)`: what every client takes (bootstrap, client id,
  SASL/SSL pass-through, request timeout, retry backoff), built from
  `KafkaSettings`; the same for the embedded tansu broker and a real cluster.
- `make_producer(kafka, role, **overrides)`: a producer for one of the
  `PRODUCER_ROLES` (their settings and why are listed below), with the
  caller's overrides on top.
- `make_consumer(kafka, *topics, **overrides)`: a consumer. The rlstream
  default is no consumer group and no auto-commit (partitions are assigned and
  offsets are the caller's); a caller that wants a group passes `group_id`.
- `make_admin(kafka)`: the admin client of `ensure_topics`.
- `end_offsets(consumer, tps, timeout_ms)`: where partitions end, with the
  tansu quirk handled (see its docstring; the one place that describes it).

Construction failures raise `BrokerError` naming the bootstrap servers.

Producer roles (M = kafka.max_message_bytes, rt = kafka.request_timeout_ms):
- `rollouts` (`RolloutPublisher`): acks=all; idempotent if the broker supports
  it (the publisher probes and passes it); retries 2^31-1 within
  `delivery_timeout_ms` = 2 rt + linger; `max_request_size` M; 1 MiB batches,
  linger 2 ms, 5 in flight, `kafka.compression`; no topic auto-creation.
- `dlq` (`DeadLetterWriter`: the reader, the prompt topic): acks=all, not
  idempotent, 5 retries; `max_request_size` M + 1 MiB (original bytes plus
  headers); linger 0; `delivery_timeout_ms` 2 rt; `max_block_ms` rt.
- `control` (`ControlPlaneWriter`): acks=all, not idempotent, 5 retries.

Not idempotent where a re-sent message is harmless (control values and
announcements are absolute; a dead letter may be stored twice): kafka-python's
idempotent producer stays wedged after its batches expire in a broker outage
(common/kafka/publisher.py), and only the publisher rebuilds its producer.

`ensure_topics(kafka)` creates the four rlstream topics, idempotently:

| topic (setting)      | partitions                  | configs                                    |
|----------------------|-----------------------------|--------------------------------------------|
| topics.rollouts      | topics.rollouts_partitions  | max.message.bytes = kafka.max_message_bytes|
| topics.policy        | 1                           | max.message.bytes (small messages anyway)  |
| topics.control       | 1                           | cleanup.policy=compact                     |
| topics.dlq           | 1                           | max.message.bytes (holds original bytes)   |

Existing topics are left as they are (a warning if the rollouts topic has
fewer partitions than configured: Kafka cannot shrink, and growing it would
move groups between partitions).

What tansu 0.6.0 (memory storage) does with this, measured with kafka-python
3.0.12 (see docs/kafka.md): it accepts CreateTopics with configs but does not
report them back (DescribeConfigs answers empty), does not enforce
`max.message.bytes` (a 2 MiB record went into a 1 MiB topic; 60 MiB records
are accepted), does not compact (all versions of a key stay readable), and
auto-creates unknown topics on produce. Apache Kafka honours all three
configs, so they are set for real clusters.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError

log = logging.getLogger("rlstream.kafka")

# Framing overhead a fetch response adds around one record batch of one record.
FETCH_OVERHEAD_BYTES = 1 << 20


def client_kwargs(kafka: KafkaSettings) -> dict[str, Any]:
    """Connection kwargs shared by KafkaProducer, KafkaConsumer and KafkaAdminClient.

    Only settings that are set are passed, so kafka-python's defaults apply to
    the rest. Raises BrokerError if `bootstrap_servers` is unset (call
    `rlstream.common.kafka.broker.ensure_broker` first).
    """
    if not kafka.bootstrap_servers:
        raise BrokerError("kafka.bootstrap_servers is unset: start the embedded broker with "
                          "rlstream.common.kafka.broker.ensure_broker() or set it to your cluster")
    kw: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in kafka.bootstrap_servers.split(",") if s.strip()],
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": kafka.request_timeout_ms,
        "retry_backoff_ms": kafka.retry_backoff_ms,
    }
    optional = {
        "sasl_mechanism": kafka.sasl_mechanism,
        "sasl_plain_username": kafka.sasl_plain_username,
        "sasl_plain_password": kafka.sasl_plain_password,
        "ssl_cafile": kafka.ssl_cafile,
        "ssl_certfile": kafka.ssl_certfile,
        "ssl_keyfile": kafka.ssl_keyfile,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        kw["ssl_check_hostname"] = kafka.ssl_check_hostname
    return kw


# ------------------------------------------------------------------ clients

def _rollouts_producer(kafka: KafkaSettings) -> dict[str, Any]:
    rt, linger = kafka.request_timeout_ms, 2
    return dict(acks="all", enable_idempotence=True, retries=2**31 - 1, max_request_size=kafka.max_message_bytes,
                compression_type=None if kafka.compression == "none" else kafka.compression,
                linger_ms=linger, batch_size=1 << 20, delivery_timeout_ms=2 * rt + linger, max_block_ms=rt,
                max_in_flight_requests_per_connection=5,
                allow_auto_create_topics=False)  # topics come from ensure_topics, with their partitions and configs


def _dlq_producer(kafka: KafkaSettings) -> dict[str, Any]:
    rt = kafka.request_timeout_ms
    return dict(acks="all", enable_idempotence=False, retries=5,
                max_request_size=kafka.max_message_bytes + FETCH_OVERHEAD_BYTES,
                linger_ms=0, delivery_timeout_ms=2 * rt, max_block_ms=rt)


def _control_producer(kafka: KafkaSettings) -> dict[str, Any]:
    return dict(acks="all", enable_idempotence=False, retries=5)


ProducerRole = Literal["rollouts", "dlq", "control"]

PRODUCER_ROLES: dict[str, Callable[[KafkaSettings], dict[str, Any]]] = {
    "rollouts": _rollouts_producer,
    "dlq": _dlq_producer,
    "control": _control_producer,
}
"""role -> its producer settings (the module docstring's table)."""


def producer_kwargs(kafka: KafkaSettings, role: ProducerRole, **overrides) -> dict[str, Any]:
    """Everything `make_producer` passes to KafkaProducer: connection, role, overrides (later wins)."""
    return {**client_kwargs(kafka), **PRODUCER_ROLES[role](kafka), **overrides}


def consumer_kwargs(kafka: KafkaSettings, **overrides) -> dict[str, Any]:
    """Everything `make_consumer` passes to KafkaConsumer: connection, no group, no auto-commit, overrides."""
    return {**client_kwargs(kafka), "group_id": None, "enable_auto_commit": False, **overrides}


def make_producer(kafka: KafkaSettings, role: ProducerRole, **overrides):
    """A KafkaProducer for `role` (see PRODUCER_ROLES), `overrides` on top. BrokerError if it cannot be built."""
    from kafka import KafkaProducer

    return _build(KafkaProducer, kafka, producer_kwargs(kafka, role, **overrides), f"{role} producer")


def make_consumer(kafka: KafkaSettings, *topics: str, **overrides):
    """A KafkaConsumer (subscribed to `topics` if given), `overrides` on top. BrokerError if it cannot be built."""
    from kafka import KafkaConsumer

    kwargs = consumer_kwargs(kafka, **overrides)
    return _build(lambda **kw: KafkaConsumer(*topics, **kw), kafka, kwargs, "consumer")


def make_admin(kafka: KafkaSettings):
    """A KafkaAdminClient (it connects at once). BrokerError if the broker cannot be reached."""
    from kafka import KafkaAdminClient

    return _build(KafkaAdminClient, kafka, client_kwargs(kafka), "admin client")


def _build(cls, kafka: KafkaSettings, kwargs: dict[str, Any], what: str):
    try:
        return cls(**kwargs)
    except Exception as e:
        raise BrokerError(f"cannot create a Kafka {what} for {kafka.bootstrap_servers} ({type(e).__name__}: {e}); "
                          "is the broker running and kafka.bootstrap_servers right?") from e


# -------------------------------------------------------------- end offsets

def end_offsets(consumer, tps: Iterable, timeout_ms: int) -> dict[int, int]:
    """{partition: end offset} of `tps` (TopicPartitions of one topic): the offset the next record gets.

    The tansu quirk, described here once: tansu 0.6 answers
    ListOffsets(latest) -- kafka-python's `end_offsets()`, also behind
    `seek_to_end` -- with the last record batch's base offset + 1, an
    under-count whenever that batch holds several records (9 for 13 records,
    measured; Apache Kafka answers 13). Fetch responses carry the right high
    watermark, so this helper prefers it: a partition `consumer` has assigned
    and fetched is answered from its high watermark, every other one by
    ListOffsets (on tansu a lower bound). A producer knows more than
    ListOffsets about partitions it wrote to: a partition's end is at least
    1 + the offset of its newest acknowledged record, so it raises the answer
    to that (producer/service.py, from its delivery callbacks).

    Raises BrokerError if ListOffsets fails or times out (`timeout_ms`).
    """
    tps = list(tps)
    assigned = consumer.assignment()
    out: dict[int, int] = {}
    ask = []
    for tp in tps:
        hw = consumer.highwater(tp) if tp in assigned else None
        if hw is None:
            ask.append(tp)
        else:
            out[tp.partition] = int(hw)
    if ask:
        try:
            answer = consumer.end_offsets(ask, timeout_ms=timeout_ms)
        except Exception as e:
            raise BrokerError(f"ListOffsets for {sorted(tp.partition for tp in ask)} of {ask[0].topic} failed "
                              f"({type(e).__name__}: {e}); is the broker reachable?") from e
        out.update({tp.partition: int(off) for tp, off in answer.items()})
    return out


def at_high_watermark(consumer, tp) -> bool:
    """`consumer` has read `tp` to the high watermark of its last fetch response (the
    right end on tansu, unlike ListOffsets: `end_offsets`); False before any fetch."""
    hw = consumer.highwater(tp)
    return hw is not None and consumer.position(tp) >= hw


# ------------------------------------------------------------------- topics

def topic_specs(kafka: KafkaSettings) -> dict[str, tuple[int, dict[str, str]]]:
    """name -> (partitions, topic configs) of every rlstream topic."""
    t = kafka.topics
    big = {"max.message.bytes": str(kafka.max_message_bytes)}
    return {
        t.rollouts: (t.rollouts_partitions, dict(big)),
        t.policy: (1, dict(big)),
        t.control: (1, {"cleanup.policy": "compact"}),
        # a dead letter keeps its original bytes plus headers: leave room above the limit
        t.dlq: (1, {"max.message.bytes": str(kafka.max_message_bytes + (1 << 20))}),
    }


def ensure_topics(kafka: KafkaSettings) -> dict[str, str]:
    """Create the missing rlstream topics. Returns {topic: "created" | "exists"}.

    Idempotent and safe to run concurrently from several services: a topic
    created by someone else between the listing and the create counts as "exists".
    """
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    specs = topic_specs(kafka)
    admin = make_admin(kafka)
    out: dict[str, str] = {}
    try:
        existing = set(admin.list_topics())
        for name, (partitions, configs) in specs.items():
            if name in existing:
                out[name] = "exists"
                continue
            try:
                admin.create_topics([NewTopic(name, partitions, kafka.topics.replication_factor,
                                              topic_configs=configs)])
                out[name] = "created"
                log.info("created topic %s (partitions=%d, configs=%s)", name, partitions, configs)
            except TopicAlreadyExistsError:
                out[name] = "exists"
        _check_partitions(admin, kafka)
    except BrokerError:
        raise
    except Exception as e:
        raise BrokerError(f"topic administration on {kafka.bootstrap_servers} failed "
                          f"({type(e).__name__}: {e})") from e
    finally:
        admin.close()
    return out


def _check_partitions(admin, kafka: KafkaSettings) -> None:
    name, want = kafka.topics.rollouts, kafka.topics.rollouts_partitions
    for t in admin.describe_topics([name]):
        have = len(t.get("partitions") or [])
        if have and have != want:
            log.warning("topic %s has %d partitions, kafka.topics.rollouts_partitions=%d; keeping %d "
                        "(repartitioning would move groups between partitions)", name, have, want, have)
