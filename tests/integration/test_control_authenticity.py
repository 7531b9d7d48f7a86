"""The control topic applies only what a holder of the admin token wrote (common/control/signing.py).

A plain Kafka client with write access to `rlstream.control` (no token) writes
the settings the hostile test wrote on c99ceb0, where every one was applied:
`max_staleness: 0`, `decay: 0.5`, `paused: true`. Every service reads the
topic through `ControlFollower`, so that is what runs here, on the session
broker: none of them applies, each is counted by reason and logged; a change
the admin API's writer signed applies; a signed record copied and written
again after a newer one is refused as replayed; a service without a token
applies nothing and says why.
"""
from __future__ import annotations

import json
import logging

import pytest

from rlstream.common import metrics
from rlstream.common.config import ControlSettings
from rlstream.common.control.messages import encode_control
from rlstream.common.control.plane import ControlFollower, ControlPlaneWriter
from rlstream.common.control.signing import HEADER, signature, signing_key
from rlstream.common.errors import ConfigError
from rlstream.harness.census import read_topic
from tests.support.configs import ADMIN_TOKEN

pytestmark = [pytest.mark.broker]

KEY = signing_key(ADMIN_TOKEN)


def _unverified(reason: str) -> float:
    return metrics.value("rlstream_control_unverified_total", reason=reason) or 0.0


def _write(kafka, key: bytes, value: bytes, headers=()) -> None:
    """One record on the control topic from a plain kafka-python client (acks=all)."""
    from kafka import KafkaProducer

    from rlstream.common.kafka.client import client_kwargs

    p = KafkaProducer(**client_kwargs(kafka), acks="all")
    try:
        p.send(kafka.topics.control, key=key, value=value, headers=list(headers)).get(timeout=30)
    finally:
        p.close(timeout=10)


@pytest.mark.timeout(120)
def test_only_signed_fresh_control_records_apply(kafka_settings, caplog):
    kafka = kafka_settings
    initial = ControlSettings()
    before = {r: _unverified(r) for r in ("unsigned", "bad_signature", "replayed", "no_key")}
    follower = ControlFollower(kafka, initial, KEY)
    writer = ControlPlaneWriter(kafka, KEY)
    try:
        with caplog.at_level(logging.WARNING, logger="rlstream.common.control.plane"):
            for key, value in (("max_staleness", 0), ("decay", 0.5), ("paused", True)):  # no signature
                _write(kafka, *encode_control(key, value, by="hostile"))
            k, v = encode_control("paused", True, by="hostile")  # signed with another deployment's token
            _write(kafka, k, v, [(HEADER, signature(signing_key("another-token"), k, v))])
            follower.catch_up()
        assert follower.view.state == initial, follower.view.state
        assert _unverified("unsigned") - before["unsigned"] == 3
        assert _unverified("bad_signature") - before["bad_signature"] == 1
        assert "unsigned" in caplog.text and "bad_signature" in caplog.text

        # the admin API's writer signs: applied
        writer.set_control("max_staleness", 5, by="admin")
        writer.set_control("paused", True, by="admin")
        follower.catch_up()
        assert (follower.view.state.max_staleness, follower.view.state.paused) == (5, True)

        # that signed `paused: true`, copied and written again after a newer value: refused
        writer.set_control("paused", False, by="admin")
        follower.catch_up()
        assert follower.view.state.paused is False
        old = next(m for m in read_topic(kafka, kafka.topics.control, quiet_s=0.5)
                   if m.key == b"paused" and json.loads(m.value) | {"at": 0} == {"value": True, "by": "admin", "at": 0})
        _write(kafka, old.key, old.value, old.headers)
        follower.catch_up()
        assert follower.view.state.paused is False
        assert _unverified("replayed") - before["replayed"] == 1, {r: _unverified(r) for r in before}
    finally:
        writer.close()
        follower.close()

    # a service without a token applies no control record, even a signed one
    keyless = ControlFollower(kafka, initial, None)
    try:
        keyless.catch_up()
        assert keyless.view.state == initial
        assert _unverified("no_key") - before["no_key"] >= 3
    finally:
        keyless.close()
    keyless_writer = ControlPlaneWriter(kafka, None)
    try:
        with pytest.raises(ConfigError, match="no admin token"):
            keyless_writer.set_control("paused", True, by="admin")
    finally:
        keyless_writer.close()


@pytest.mark.timeout(120)
def test_only_signed_weight_announcements_apply(kafka_settings):
    """The policy topic too: a WeightsReady a plain client writes (a version a million ahead, a
    foreign endpoint, a durable copy anywhere) is not taken by a service holding the token; the
    trainer's signed announcement is. (Producers also take durable copies only from their
    weight store, producer/weights/reload.py; the consumer bounds record versions by its own.)"""
    from rlstream.common.control.messages import WeightsReady

    kafka = kafka_settings
    forged = WeightsReady(version=1_000_000, transport="collective", digest="f" * 64, endpoint="10.9.9.9:1",
                          backend="rlstream_gloo", durable_version=1_000_000, durable_uri="file:///tmp/evil",
                          durable_sha256="0" * 64, durable_bytes=1)
    before = _unverified("unsigned")
    follower, writer = ControlFollower(kafka, ControlSettings(), KEY), ControlPlaneWriter(kafka, KEY)
    try:
        _write_policy(kafka, forged)
        follower.catch_up()
        assert follower.view.weights is None and _unverified("unsigned") == before + 1
        real = WeightsReady(version=3, transport="collective", digest="a" * 64, endpoint="trainer:29600",
                            backend="rlstream_gloo")
        writer.announce(real)
        follower.catch_up()
        assert follower.view.weights == real
    finally:
        writer.close()
        follower.close()


def _write_policy(kafka, msg) -> None:
    from kafka import KafkaProducer

    from rlstream.common.kafka.client import client_kwargs

    p = KafkaProducer(**client_kwargs(kafka), acks="all")
    try:
        p.send(kafka.topics.policy, key=msg.kind.encode(), value=msg.model_dump_json().encode()).get(timeout=30)
    finally:
        p.close(timeout=10)
