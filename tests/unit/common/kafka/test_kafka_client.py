"""The driver layer (common/kafka/client.py) without a broker: what each client is built with, and the
end-offsets helper's tansu handling against fake answers. The real clients are exercised against the real
broker in tests/integration/test_kafka_roundtrip.py and test_security.py."""
from __future__ import annotations

import pytest
from kafka import TopicPartition

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError
from rlstream.common.kafka.client import (
    client_kwargs,
    consumer_kwargs,
    end_offsets,
    make_admin,
    make_consumer,
    make_producer,
    producer_kwargs,
)

M, RT = 64 << 20, 30_000


def secure() -> KafkaSettings:
    return KafkaSettings(bootstrap_servers="a:9093, b:9093", security_protocol="SASL_SSL",
                         sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="u", sasl_plain_password="p",
                         ssl_cafile="/ca.pem", ssl_certfile="/c.pem", ssl_keyfile="/k.pem", ssl_check_hostname=False,
                         compression="zstd")


SECURITY = {"bootstrap_servers": ["a:9093", "b:9093"], "client_id": "rlstream", "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u", "sasl_plain_password": "p",
            "ssl_cafile": "/ca.pem", "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem", "ssl_check_hostname": False,
            "request_timeout_ms": RT, "retry_backoff_ms": 200}


def test_client_kwargs_pass_sasl_ssl_through():
    assert client_kwargs(secure()) == SECURITY
    plain = client_kwargs(KafkaSettings(bootstrap_servers="a:1"))
    assert plain["security_protocol"] == "PLAINTEXT" and not {"ssl_certfile", "sasl_mechanism",
                                                              "ssl_check_hostname"} & set(plain)
    with pytest.raises(BrokerError, match="bootstrap_servers"):
        client_kwargs(KafkaSettings())


# Each role's settings, exactly as the construction sites had them before the driver layer.
ROLES = {
    "rollouts": dict(acks="all", enable_idempotence=True, retries=2**31 - 1, max_request_size=M,
                     compression_type="zstd", linger_ms=2, batch_size=1 << 20, delivery_timeout_ms=2 * RT + 2,
                     max_block_ms=RT, max_in_flight_requests_per_connection=5, allow_auto_create_topics=False),
    "dlq": dict(acks="all", enable_idempotence=False, retries=5, max_request_size=M + (1 << 20), linger_ms=0,
                delivery_timeout_ms=2 * RT, max_block_ms=RT),
    "control": dict(acks="all", enable_idempotence=False, retries=5),
}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_producer_roles_keep_each_sites_settings_on_top_of_the_connection(role):
    assert producer_kwargs(secure(), role) == {**SECURITY, **ROLES[role]}


def test_producer_overrides_win_and_compression_none_is_off():
    kw = producer_kwargs(secure(), "rollouts", enable_idempotence=False, linger_ms=7, api_version=(2, 8))
    assert (kw["enable_idempotence"], kw["linger_ms"], kw["api_version"]) == (False, 7, (2, 8))
    assert kw["sasl_plain_password"] == "p"
    assert producer_kwargs(KafkaSettings(bootstrap_servers="a:1"), "rollouts")["compression_type"] is None


def test_consumer_defaults_to_no_group_and_no_auto_commit():
    assert consumer_kwargs(secure()) == {**SECURITY, "group_id": None, "enable_auto_commit": False}
    grouped = consumer_kwargs(secure(), group_id="g", enable_auto_commit=True, fetch_max_wait_ms=50)
    assert (grouped["group_id"], grouped["enable_auto_commit"], grouped["fetch_max_wait_ms"]) == ("g", True, 50)


class Recorder:
    """Stands in for a kafka-python client class: records how it was built."""

    built: list = []

    def __init__(self, *topics, **kw):
        self.topics, self.kw = topics, kw
        Recorder.built.append(self)


@pytest.fixture
def recorded(monkeypatch):
    import kafka

    Recorder.built = []
    for name in ("KafkaProducer", "KafkaConsumer", "KafkaAdminClient"):
        monkeypatch.setattr(kafka, name, type(name, (Recorder,), {}))
    return Recorder.built


def test_make_functions_build_clients_with_the_security_settings(recorded):
    p = make_producer(secure(), "dlq", linger_ms=5)
    c = make_consumer(secure(), "prompts", group_id="g", enable_auto_commit=True)
    a = make_admin(secure())
    assert [type(x).__name__ for x in (p, c, a)] == ["KafkaProducer", "KafkaConsumer", "KafkaAdminClient"]
    assert p.kw == {**SECURITY, **ROLES["dlq"], "linger_ms": 5}
    assert c.topics == ("prompts",) and c.kw == {**SECURITY, "group_id": "g", "enable_auto_commit": True}
    assert a.topics == () and a.kw == SECURITY


def test_a_client_that_cannot_be_built_is_a_broker_error_naming_the_servers(monkeypatch):
    import kafka

    def refuse(*a, **kw):
        raise kafka.errors.NoBrokersAvailable()
    monkeypatch.setattr(kafka, "KafkaConsumer", refuse)
    with pytest.raises(BrokerError, match="a:9093, b:9093.*NoBrokersAvailable"):
        make_consumer(secure())


# ------------------------------------------------------------- end offsets

class FakeConsumer:
    """What end_offsets reads from a KafkaConsumer: its assignment, fetch high watermarks, ListOffsets."""

    def __init__(self, assigned: dict[int, int | None], list_offsets: dict[int, int], fail: bool = False):
        self.hw = {TopicPartition("t", p): hw for p, hw in assigned.items()}
        self.list_offsets, self.fail = list_offsets, fail
        self.asked: list[list[int]] = []

    def assignment(self):
        return set(self.hw)

    def highwater(self, tp):
        assert tp in self.hw, "kafka-python raises IllegalStateError for an unassigned partition"
        return self.hw[tp]

    def end_offsets(self, tps, timeout_ms):
        self.asked.append(sorted(tp.partition for tp in tps))
        if self.fail:
            raise TimeoutError("ListOffsets timed out")
        return {tp: self.list_offsets[tp.partition] for tp in tps}


TPS = [TopicPartition("t", p) for p in range(3)]


def test_end_offsets_prefers_the_fetch_high_watermark_over_tansus_list_offsets():
    # tansu: 13 records in one batch at base 8 -> ListOffsets says 9; the fetch response says 13
    c = FakeConsumer(assigned={0: 13, 1: None}, list_offsets={0: 9, 1: 4, 2: 7})
    assert end_offsets(c, TPS, timeout_ms=250) == {0: 13, 1: 4, 2: 7}
    assert c.asked == [[1, 2]], "only partitions without a fetched high watermark go to ListOffsets"


def test_end_offsets_of_a_client_that_never_fetched_is_list_offsets():
    c = FakeConsumer(assigned={}, list_offsets={0: 9, 1: 0, 2: 3})
    assert end_offsets(c, TPS, timeout_ms=250) == {0: 9, 1: 0, 2: 3} and c.asked == [[0, 1, 2]]
    fetched = FakeConsumer(assigned={0: 13, 1: 2, 2: 0}, list_offsets={})
    assert end_offsets(fetched, TPS, timeout_ms=250) == {0: 13, 1: 2, 2: 0} and fetched.asked == []


def test_end_offsets_failure_is_a_broker_error():
    with pytest.raises(BrokerError, match=r"ListOffsets for \[0, 1, 2\] of t failed \(TimeoutError"):
        end_offsets(FakeConsumer(assigned={}, list_offsets={}, fail=True), TPS, timeout_ms=250)

