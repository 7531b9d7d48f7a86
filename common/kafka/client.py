"""Kafka connection settings and topic administration.

`client_kwargs(kafka)` turns `KafkaSettings` into the keyword arguments every
kafka-python client takes (bootstrap, client id, SASL/SSL pass-through), so the
publisher, the reader and the admin client connect the same way to the
embedded tansu broker and to a real cluster.

`ensure_topics(kafka)` creates the five rlstream topics, idempotently:

| topic (setting)      | partitions                  | configs                                    |
|----------------------|-----------------------------|--------------------------------------------|
| topics.rollouts      | topics.rollouts_partitions  | max.message.bytes = kafka.max_message_bytes|
| topics.policy        | 1                           | max.message.bytes (small messages anyway)  |
| topics.control       | 1                           | cleanup.policy=compact                     |
| topics.dlq           | 1                           | max.message.bytes (holds original bytes)   |
| topics.stale         | 1                           | max.message.bytes                          |

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
from typing import Any

from common.config import KafkaSettings
from common.errors import BrokerError

log = logging.getLogger("rlstream.kafka")

# Framing overhead a fetch response adds around one record batch of one record.
FETCH_OVERHEAD_BYTES = 1 << 20


def client_kwargs(kafka: KafkaSettings) -> dict[str, Any]:
    """Connection kwargs shared by KafkaProducer, KafkaConsumer and KafkaAdminClient.

    Only settings that are set are passed, so kafka-python's defaults apply to
    the rest. Raises BrokerError if `bootstrap_servers` is unset (call
    `common.kafka.broker.ensure_broker` first).
    """
    if not kafka.bootstrap_servers:
        raise BrokerError("kafka.bootstrap_servers is unset: start the embedded broker with "
                          "common.kafka.broker.ensure_broker() or set it to your cluster")
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
        t.stale: (1, dict(big)),
    }


def admin_client(kafka: KafkaSettings):
    from kafka import KafkaAdminClient

    try:
        return KafkaAdminClient(**client_kwargs(kafka))
    except Exception as e:
        raise BrokerError(f"cannot reach Kafka at {kafka.bootstrap_servers} ({type(e).__name__}: {e}); "
                          "is the broker running and kafka.bootstrap_servers right?") from e


def ensure_topics(kafka: KafkaSettings) -> dict[str, str]:
    """Create the missing rlstream topics. Returns {topic: "created" | "exists"}.

    Idempotent and safe to run concurrently from several services: a topic
    created by someone else between the listing and the create counts as "exists".
    """
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    specs = topic_specs(kafka)
    admin = admin_client(kafka)
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
