"""Property tests through the real broker: whatever bytes land on the rollouts topic, the reader
never crashes; each record is either returned (and then valid) or stored in the DLQ with a reason,
and the DLQ counter matches.

One topic set, publisher and reader per module (hypothesis examples share them); each example
publishes a handful of payloads and polls until `positions()` has moved past all of them.
"""
from __future__ import annotations

import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.common import metrics
from rlstream.common.kafka.publisher import RolloutPublisher
from rlstream.common.kafka.dlq import H_FIELD, H_REASON, H_SOURCE
from rlstream.common.kafka.reader import INTERNAL_FIELD, RolloutReader
from rlstream.common.record import encode
from tests.fixtures.kafka import make_kafka_settings, realistic_rollout

VALID = realistic_rollout(response_tokens=12, prompt_tokens=5, layers=3, top_k=2, num_experts=8, group_id="fz")
VALID_BYTES = encode(VALID)
VALID_MAP = msgpack.unpackb(VALID_BYTES)
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Harness:
    def __init__(self, kafka):
        self.kafka = kafka
        self.pub = RolloutPublisher(kafka)
        self.reader = RolloutReader(kafka)
        self.published = 0
        self.returned = 0

    def dlq_counter(self) -> float:
        fams = [m for m in metrics.REGISTRY.collect() if m.name == "rlstream_dlq_records"]
        return sum(s.value for f in fams for s in f.samples if s.name.endswith("_total"))

    def run(self, payloads: list[bytes], key: bytes = b"fz") -> tuple[int, int]:
        """Publish, read until consumed; returns (returned, dead-lettered) for these payloads."""
        for p in payloads:
            self.pub.publish_bytes(key, p).result(timeout=20)
        self.published += len(payloads)
        dlq0, counter0 = self.reader.dlq_total, self.dlq_counter()
        got, deadline = [], time.monotonic() + 20
        while sum(self.reader.positions().values()) < self.published and time.monotonic() < deadline:
            got += self.reader.poll(max_records=50, timeout_s=0.2)  # must never raise
        assert sum(self.reader.positions().values()) == self.published
        dead = self.reader.dlq_total - dlq0
        assert len(got) + dead == len(payloads)
        assert self.dlq_counter() - counter0 == dead
        for it in got:  # anything returned is a valid record (re-encoding validates it)
            encode(it.rollout)
        self.returned += len(got)
        return len(got), dead


@pytest.fixture(scope="module")
def harness(broker, tmp_path_factory):
    h = Harness(make_kafka_settings(broker.bootstrap, tmp_path_factory.mktemp("fuzz-blobs")))
    yield h
    h.pub.close()
    h.reader.close()


# ------------------------------------------------------------------ strategies

def _mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for kind, pos, val in ops:
        if not b:
            b.append(val)
            continue
        i = pos % len(b)
        if kind == 0:
            b[i] = val
        elif kind == 1:
            b.insert(i, val)
        elif kind == 2:
            del b[i]
        else:
            del b[i:]
    return bytes(b)


ops = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=16)
    | st.binary(max_size=48),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)


@st.composite
def map_mutations(draw) -> bytes:
    m = dict(VALID_MAP)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(VALID_MAP) + ["claim_check", "extra"]))
        if draw(st.booleans()):
            m.pop(key, None)
        else:
            m[key] = draw(msgpack_values)
    return msgpack.packb(m, use_bin_type=True)


# ----------------------------------------------------------------------- tests

@pytest.mark.broker
@pytest.mark.timeout(120)
@FUZZ
@given(payloads=st.lists(st.binary(max_size=400), min_size=1, max_size=5))
def test_random_bytes_all_land_in_dlq(harness, payloads):
    returned, dead = harness.run(payloads)
    assert returned == 0 and dead == len(payloads)


@pytest.mark.broker
@pytest.mark.timeout(120)
@FUZZ
@given(mutations=st.lists(ops, min_size=1, max_size=4))
def test_mutated_valid_records_never_crash_the_reader(harness, mutations):
    payloads = [_mutate(VALID_BYTES, o) for o in mutations]
    harness.run(payloads)  # a byte flip inside an array can leave a valid record: returned or DLQ'd


@pytest.mark.broker
@pytest.mark.timeout(120)
@FUZZ
@given(payloads=st.lists(map_mutations(), min_size=1, max_size=4))
def test_structurally_mutated_records_never_crash_the_reader(harness, payloads):
    harness.run(payloads)


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_valid_record_still_returned_and_dlq_entries_carry_reasons(harness):
    returned, dead = harness.run([VALID_BYTES])
    assert (returned, dead) == (1, 0)
    # every DLQ entry so far: original bytes, a reason, a field, its source; no decoder bug
    from kafka import TopicPartition

    from rlstream.common.kafka.client import make_consumer

    c = make_consumer(harness.kafka)
    tp = TopicPartition(harness.kafka.topics.dlq, 0)
    c.assign([tp])
    c.seek_to_beginning(tp)
    dead_total = harness.published - harness.returned
    msgs, deadline = [], time.monotonic() + 20
    while len(msgs) < dead_total and time.monotonic() < deadline:
        for batch in c.poll(timeout_ms=300).values():
            msgs += batch
    c.close()
    assert len(msgs) == dead_total > 0
    for m in msgs:
        h = dict(m.headers)
        assert h[H_REASON] and h[H_FIELD] and h[H_SOURCE].startswith(harness.kafka.topics.rollouts.encode() + b"/")
        assert h[H_FIELD].decode() != INTERNAL_FIELD, h[H_REASON]
