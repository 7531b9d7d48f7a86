"""Bad input and security (its live part) against one running consumer.

The real consumer (subprocess; real broker; Megatron-core on the tiny model)
trains on valid synthetic groups while hypothesis fuzzes the rollouts topic
with records that are truncated, of another schema version, with mismatched
lengths, NaN/inf or positive log-probs, expert ids >= num_experts, oversize
(beyond the reader's record limits) or a pickle whose unpickling would leave
a marker file; and with records that decode but must not be trained: a key
given twice, another group size, a version from the future (trainer + 1000),
a sequence longer than the model's positions (P = 600 > 512); and with
group ids reused by a second copy (another producer's copy
interleaved with a valid group, or a copy under the id of a group already
trained or waiting for its batch, or a second record for a held slot).
Afterwards: training went on, each bad record is in the DLQ under the field
its kind must be refused for (a reused id: `group_id`), and the DLQ counters
(reader and consumer, and the consumer's reuse counter) match the number of
bad records exactly; only the valid groups were trained.

Security, on the same live consumer: the admin API refuses missing or wrong
tokens and out-of-range values (and writes nothing then); out-of-range,
malformed or pickled control and policy messages put on the topics directly
are ignored and counted. Static and client-level security checks are in
test_security.py.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.harness.census import read_dlq, read_topic
from rlstream.harness.observe import http_request, metric_value
from rlstream.harness.supervisor import Service, wait_until
from tests.fixtures.kafka import make_kafka_settings
from tests.support.configs import ADMIN_TOKEN, service_config, write_config
from tests.support.synthetic import synthetic_group
from tests.support.fuzz_records import KINDS, MARKER, PICKLE_BOMB, REUSES, G, Live, bad_record, reuse
from tests.support.topics import send_raw

pytestmark = [pytest.mark.broker, pytest.mark.megatron, pytest.mark.slow]

B = 2


@pytest.fixture(scope="module")
def live(broker, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-training")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    cfg = service_config(kafka, tiny_model_dir, tmp, G=G, B=B, staleness={"max_staleness": 1000},
                         consumer={"group_timeout_s": 30.0})
    consumer = Service("consumer", write_config(cfg, tmp / "consumer.yaml"), tmp / "logs")
    MARKER.unlink(missing_ok=True)
    with consumer:
        consumer.start()
        lv = Live(kafka, consumer, Path(cfg.consumer.checkpoint_dir))
        for _ in range(B):
            lv.publish_valid_group()
        wait_until(lambda: lv.version() >= 1, 300, "the first training step", [consumer])
        consumer.wait_ready(60)
        yield lv
        lv.pub.close()


FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=1, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_one_bad_record_of_each_kind_while_training(live, kind, data):
    """Every kind at least once, whatever the fuzz below draws; then a valid group."""
    _, field, value = data.draw(bad_record((kind,)))
    live.publish_bad(kind, field, value)
    live.publish_valid_group()
    assert live.consumer.alive, live.consumer.log_tail()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", REUSES)
def test_one_reused_group_id_of_each_kind_while_training(live, how):
    """Every kind of reuse at least once, whatever the fuzz below draws (the copy's slots 0 and G-1)."""
    live.publish_valid_group((how, [0, G - 1]))
    assert live.consumer.alive, live.consumer.log_tail()


@pytest.mark.timeout(600)
@FUZZ
@given(bad=st.lists(bad_record(), min_size=1, max_size=3), reused=reuse())
def test_fuzz_rollouts_topic_while_training(live, bad, reused):
    """Each example: some bad records, then a valid group, sometimes with a reused copy
    of a group id (a step every B examples)."""
    for kind, field, value in bad:
        live.publish_bad(kind, field, value)
    live.publish_valid_group(reused)
    assert live.consumer.alive, live.consumer.log_tail()


@pytest.mark.timeout(300)
def test_training_continued_and_every_bad_record_is_in_the_dlq_with_its_reason(live):
    c = live.consumer
    n_bad = len(live.expected)
    assert n_bad >= 30 and {k for k, _ in live.expected.values()} >= set(KINDS) | {"reused"}
    want_steps = live.valid_groups // B
    wait_until(lambda: live.version() >= want_steps, 300, f"{want_steps} steps", [c])
    ours = {}
    def all_in_dlq():
        ours.clear()
        ours.update({d.source: d for d in read_dlq(live.kafka, quiet_s=0.5) if d.source in live.expected})
        return len(ours) == n_bad
    wait_until(all_in_dlq, 120, "every bad record in the DLQ", [c], interval_s=1.0)
    wrong = {s: (live.expected[s], d.field, d.reason) for s, d in ours.items() if d.field != live.expected[s][1]}
    assert not wrong, wrong
    assert all(d.reason for d in ours.values())
    # counters match: the reader's per-field DLQ counter and the consumer's dlq outcome
    text = c.scrape()
    per_field = Counter(field for _, field in live.expected.values())
    for field, n in per_field.items():
        assert metric_value(text, "rlstream_dlq_records_total", field=field) == n, field
    assert metric_value(text, "rlstream_dlq_records_total") == n_bad
    assert metric_value(text, "rlstream_consumer_records_total", outcome="dlq") == n_bad
    assert metric_value(text, "rlstream_consumer_group_reuse_total") == per_field["group_id"] > 0
    # only the valid groups (a trained copy would make another step); an odd last group waits for its batch
    assert metric_value(text, "rlstream_consumer_records_total", outcome="trained") == want_steps * B * G
    assert http_request(c.url + "/healthz")[0] == 200
    assert not MARKER.exists(), "a pickle from the rollouts topic was unpickled"


# ---------------------------------------------------------------- security (live)

def _admin(c: Service, method="GET", body=None, token=ADMIN_TOKEN, headers=None):
    return http_request(c.url + "/admin/control", method, body, token=token, headers=headers)


def _steps_until(live: Live, pred, what: str, timeout: float = 150):
    """Keep the consumer stepping until `pred()`: its follower is polled (timeout 0) only at
    batch boundaries, so a change shows up after one or a few steps."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert live.consumer.alive, live.consumer.log_tail()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        v = live.version()
        for _ in range(B):
            live.publish_valid_group()
        wait_until(lambda: live.version() > v, 120, "a step", [live.consumer])


def _control_messages(kafka) -> int:
    return len(read_topic(kafka, kafka.topics.control, quiet_s=0.5))


@pytest.mark.timeout(120)
def test_admin_api_refuses_missing_and_wrong_tokens(live):
    c = live.consumer
    before = _control_messages(live.kafka)
    unauthorized0 = c.metric("rlstream_admin_requests_total", outcome="unauthorized")
    attempts = [
        dict(token=None),
        dict(token="wrong"),
        dict(token=ADMIN_TOKEN[:-1]),
        dict(token=ADMIN_TOKEN + "x"),
        dict(token=None, headers={"Authorization": ADMIN_TOKEN}),  # no "Bearer "
        dict(token=None, headers={"Authorization": f"Basic {ADMIN_TOKEN}"}),
        dict(token=None, headers={"Authorization": f"bearer {ADMIN_TOKEN}"}),
        dict(token=""),
    ]
    for a in attempts:
        assert _admin(c, "GET", **a)[0] == 401, a
        code, body = _admin(c, "POST", {"key": "max_staleness", "value": 0}, **a)
        assert code == 401, (a, body)
    assert c.metric("rlstream_admin_requests_total", outcome="unauthorized") - unauthorized0 == 2 * len(attempts)
    assert _control_messages(live.kafka) == before, "a refused request wrote to the control topic"
    code, body = _admin(c, "GET")
    assert code == 200 and json.loads(body)["max_staleness"] == 1000


@pytest.mark.timeout(120)
def test_admin_api_rejects_out_of_range_values_and_writes_nothing(live):
    c = live.consumer
    before = _control_messages(live.kafka)
    bad = [("max_staleness", -1), ("max_staleness", 1001), ("max_staleness", "many"), ("max_staleness", 1.5),
           ("mode", "yolo"), ("decay", 0), ("decay", 1.5), ("decay", "nan"), ("paused", "maybe"),
           ("unknown_key", 1), ("__class__", "x"),
           # strict types: JSON true is not max_staleness 1, nor "3" the integer 3, nor 1 paused
           ("max_staleness", True), ("max_staleness", "3"), ("decay", True), ("paused", 1)]
    for key, value in bad:
        code, body = _admin(c, "POST", {"key": key, "value": value})
        assert code == 400, (key, value, body)
    for body in (b"not json", b"[1, 2]", b'{"key": "mode"}', b"\x80\x04pickle"):
        assert _admin(c, "POST", body)[0] == 400, body
    assert _control_messages(live.kafka) == before, "a rejected value reached the control topic"
    # a valid change goes through and is applied at a batch boundary
    code, body = _admin(c, "POST", {"key": "max_staleness", "value": 999})
    assert code == 200 and json.loads(body) == {"key": "max_staleness", "value": 999}
    _steps_until(live, lambda: json.loads(_admin(c)[1])["max_staleness"] == 999, "the change applied")
    assert c.metric("rlstream_control_setting", key="max_staleness") == 999


@pytest.mark.timeout(180)
def test_out_of_range_and_hostile_control_messages_on_the_topic_are_ignored(live):
    c = live.consumer
    k = live.kafka
    rejected0 = {t: c.metric("rlstream_control_rejected_total", topic=t) for t in ("control", "policy")}
    settings = ("max_staleness", "mode", "decay", "paused", "max_staleness_auto")
    state0 = {key: json.loads(_admin(c)[1])[key] for key in settings}
    hostile_control = [
        (b"max_staleness", json.dumps({"value": -5}).encode()),
        (b"max_staleness", json.dumps({"value": 10**9}).encode()),
        (b"max_staleness", json.dumps({"value": "3; rm -rf /"}).encode()),
        (b"mode", json.dumps({"value": "__import__('os').system('id')"}).encode()),
        (b"decay", json.dumps({"value": -0.5}).encode()),
        (b"decay", json.dumps({"value": 7}).encode()),
        (b"paused", json.dumps({"value": "perhaps"}).encode()),
        (b"max_staleness", json.dumps({"value": True}).encode()),  # not 1: strictly typed
        (b"paused", json.dumps({"value": 1}).encode()),
        (b"evil", json.dumps({"value": 1}).encode()),
        (b"max_staleness", b"not json"),
        (b"max_staleness", json.dumps({"nothing": 1}).encode()),
        (b"max_staleness", PICKLE_BOMB),
    ]
    for key, value in hostile_control:
        send_raw(k, k.topics.control, key, value)
    ok_sha = "0" * 64
    ready = {"kind": "weights_ready", "transport": "file", "uri": "file:///x"}
    progress = {"kind": "trainer_progress", "groups_per_batch": 2, "group_size": 4}
    hostile_policy = [
        json.dumps({**ready, "version": -1, "sha256": ok_sha, "bytes": 1}),
        json.dumps({**ready, "version": 10**6, "sha256": "short", "bytes": 1}),
        json.dumps({**ready, "version": 10**6, "sha256": ok_sha, "bytes": 0}),
        json.dumps({**ready, "version": 10**6, "sha256": ok_sha, "bytes": 1, "exec": "__import__('os')"}),
        json.dumps({"version": 10**6, "uri": "file:///x", "sha256": ok_sha, "bytes": 1}),  # no kind
        json.dumps({**progress, "trainer_version": -3}),
        json.dumps({**progress, "trainer_version": 1, "groups_per_batch": 0}),
        "not json",
    ]
    for value in hostile_policy:
        send_raw(k, k.topics.policy, b"policy", value.encode())
    send_raw(k, k.topics.policy, b"policy", PICKLE_BOMB)
    want = {"control": len(hostile_control), "policy": len(hostile_policy) + 1}
    _steps_until(live, lambda: all(c.metric("rlstream_control_rejected_total", topic=t) - rejected0[t] >= n
                                   for t, n in want.items()), "hostile control messages counted")
    for t, n in want.items():
        assert c.metric("rlstream_control_rejected_total", topic=t) - rejected0[t] == n, t
    state = json.loads(_admin(c)[1])
    assert {key: state[key] for key in settings} == state0, state  # nothing the messages said was applied
    assert not MARKER.exists(), "a pickle from the control or policy topic was unpickled"
    assert c.alive


# ---------------------------------------------------------------- schema-valid poison (last: it may kill the consumer)

@pytest.mark.timeout(300)
def test_schema_valid_record_the_model_cannot_take_does_not_stop_training(live):
    """A record that decodes and validates but does not fit the model (token id >= vocab):
    the consumer must refuse it (DLQ or drop, counted), not crash-loop on it."""
    from rlstream.toy.tinymodel import TinyModelSpec

    c = live.consumer
    rng = np.random.default_rng(5)
    group = synthetic_group("poison", G, live.version(), rng)
    bad = group[0]
    bad.response_ids = np.array(bad.response_ids, dtype=np.int32)
    bad.response_ids[0] = TinyModelSpec().vocab_size + 1000
    for f in [live.pub.publish(r, timeout=60) for r in group]:
        f.result(timeout=60)
    v = live.version()
    for _ in range(2 * B):
        live.publish_valid_group()
    wait_until(lambda: live.version() >= v + 2 or not c.alive, 180, "two more steps")
    assert c.alive, "consumer died on a schema-valid record with a token id beyond the vocabulary:\n" +\
        c.log_tail(3000)
