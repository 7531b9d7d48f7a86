"""Test-only topic access: raw writes (no validation at all) and the weights announced.

Reading whole topics back (read_topic, read_dlq, read_rollouts) is the
harness's: common/harness/census.py.
"""
from __future__ import annotations

from common.config import KafkaSettings
from common.harness.census import read_topic


def latest_policy(kafka: KafkaSettings):
    """The newest WeightsReady on the policy topic (None if none)."""
    announced = weights_announcements(kafka)
    return max(announced, key=lambda a: a.version) if announced else None


def weights_announcements(kafka: KafkaSettings) -> list:
    """Every WeightsReady on the policy topic, in log order."""
    from common.control.messages import WeightsReady, parse_policy_message

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

    from common.kafka.client import client_kwargs

    p = KafkaProducer(**client_kwargs(kafka), acks="all", max_request_size=kafka.max_message_bytes)
    try:
        p.send(topic, key=key, value=value).get(timeout=30)
    finally:
        p.close(timeout=10)
