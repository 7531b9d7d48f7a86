"""Publisher -> real tansu broker (TCP, loopback) -> reader: shapes, claim check, keys, DLQ, offsets;
the dead-letter writer and the end-offsets helper against the real broker."""
from __future__ import annotations

import hashlib
import os
import socket
import time

import msgpack
import numpy as np
import pytest

from rlstream.common import metrics
from rlstream.common.kafka.claimcheck import BlobStore
from rlstream.common.kafka.broker import EmbeddedBroker, ensure_broker, kafka_ping
from rlstream.common.config import BrokerSettings, KafkaSettings
from rlstream.common.errors import BrokerError, InvalidRecordError, OffsetError
from rlstream.common.kafka.client import end_offsets, ensure_topics, make_consumer
from rlstream.common.kafka.dlq import H_FIELD, H_REASON, H_SOURCE, DeadLetterWriter
from rlstream.common.kafka.publisher import RolloutPublisher
from rlstream.common.kafka.reader import RolloutReader
from rlstream.common.record import encode
from rlstream.harness.supervisor import Service, wait_until
from tests.fixtures.kafka import make_kafka_settings, realistic_rollout


# ---------------------------------------------------------------- helpers

def read_n(reader: RolloutReader, n: int, timeout_s: float = 30.0) -> list:
    items, deadline = [], time.monotonic() + timeout_s
    while len(items) < n and time.monotonic() < deadline:
        items += reader.poll(max_records=64, timeout_s=0.5)
    return items


def read_topic_raw(kafka: KafkaSettings, topic: str, n: int, timeout_s: float = 20.0) -> list:
    """Every message of `topic` (all partitions) with a plain kafka-python consumer, until n are seen."""
    from kafka import TopicPartition

    c = make_consumer(kafka, max_partition_fetch_bytes=80 << 20, fetch_max_bytes=80 << 20)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or {0})]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=300).values():
                out += msgs
        time.sleep(0.3)  # anything beyond n would show up now
        for msgs in c.poll(timeout_ms=300).values():
            out += msgs
        return out
    finally:
        c.close()


def assert_same(a, b) -> None:
    for name in ("rollout_id", "group_id", "sample_idx", "group_size", "policy_version", "reward",
                 "finish_reason", "num_experts", "routing_scope", "reward_info", "prompt_text"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("prompt_ids", "response_ids", "logprobs", "token_versions", "routed_experts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


# ------------------------------------------------------------ round trips

@pytest.mark.broker
@pytest.mark.timeout(120)
def test_realistic_records_round_trip(kafka_settings):
    """4,096 response tokens, 48 layers, top-8 of 128 experts (~1.7 MB each), two groups of 4."""
    rs = [realistic_rollout(seed=i, group_id=f"grp-{i % 2}", sample_idx=i // 2, group_size=4) for i in range(8)]
    assert len(encode(rs[0])) > 1_600_000
    with RolloutPublisher(kafka_settings) as pub:
        futs = [pub.publish(r, timeout=30) for r in rs]
        deliveries = [f.result(timeout=60) for f in futs]
        assert pub.buffer_depth == 0
    assert all(d.attempts == 1 and not d.claim_check for d in deliveries)
    with RolloutReader(kafka_settings) as rd:
        items = read_n(rd, 8)
        assert len(items) == 8
        by_id = {it.rollout.rollout_id: it for it in items}
        for r, d in zip(rs, deliveries):
            it = by_id[r.rollout_id]
            assert (it.partition, it.offset) == (d.partition, d.offset)
            assert_same(r, it.rollout)
            assert it.rollout.routed_experts.shape == (256 + 4096 - 1, 48, 8)
        assert rd.lag() == 0
        ends = {}
        for d in deliveries:
            ends[d.partition] = max(ends.get(d.partition, 0), d.offset + 1)
        assert {p: o for p, o in rd.positions().items() if o} == ends
        assert rd.poll(timeout_s=0.3) == []


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_same_group_same_partition_in_order(kafka_settings):
    rs = [realistic_rollout(response_tokens=32, prompt_tokens=8, layers=2, seed=100 + i, group_id=f"g{i % 5}",
                            sample_idx=i // 5, group_size=8) for i in range(40)]
    with RolloutPublisher(kafka_settings) as pub:
        deliveries = [f.result(timeout=30) for f in [pub.publish(r) for r in rs]]
    assert all(d.attempts == 1 for d in deliveries)
    with RolloutReader(kafka_settings) as rd:
        items = read_n(rd, 40)
    assert len(items) == 40
    parts: dict[str, set] = {}
    for it in items:
        parts.setdefault(it.rollout.group_id, set()).add(it.partition)
    assert all(len(p) == 1 for p in parts.values()), parts
    assert len({next(iter(p)) for p in parts.values()}) > 1, "5 groups all hashed to one partition"
    for g in parts:
        in_offset_order = [it.rollout.sample_idx for it in sorted(items, key=lambda i: i.offset)
                           if it.rollout.group_id == g]
        assert in_offset_order == list(range(8))


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_claim_check_for_large_records(broker, tmp_path):
    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", claim_check_bytes=1 << 20)
    big = realistic_rollout(seed=7, group_id="big")           # ~1.7 MB > 1 MiB: claim check
    small = realistic_rollout(response_tokens=64, prompt_tokens=8, layers=4, seed=8, group_id="big",
                              sample_idx=1)                 # stays inline
    with RolloutPublisher(kafka) as pub:
        d_big, d_small = pub.publish(big).result(30), pub.publish(small).result(30)
    assert d_big.claim_check and d_big.nbytes < 1024
    assert not d_small.claim_check
    # on Kafka: a small pointer; in the store: the full record, named by its sha256
    raw = read_topic_raw(kafka, kafka.topics.rollouts, 2)
    assert sorted(len(m.value) for m in raw)[0] < 1024
    full = encode(big)
    blob = tmp_path / "blobs" / hashlib.sha256(full).hexdigest()[:2] / hashlib.sha256(full).hexdigest()
    assert blob.read_bytes() == full
    with RolloutReader(kafka) as rd:
        items = read_n(rd, 2)
    assert {it.rollout.rollout_id: it.claim_check for it in items} == {big.rollout_id: True, small.rollout_id: False}
    assert_same(big, next(it.rollout for it in items if it.claim_check))

    # a corrupted and a missing blob go to the DLQ naming the claim check
    blob.write_bytes(full[:-1] + bytes([full[-1] ^ 1]))
    dlq_before = metrics.value("rlstream_dlq_records_total", field="claim_check")
    with RolloutReader(kafka, blobs=BlobStore(tmp_path / "blobs")) as rd:
        assert [it.rollout.rollout_id for it in read_n(rd, 1, timeout_s=3)] == [small.rollout_id]
    blob.unlink()
    with RolloutReader(kafka, blobs=BlobStore(tmp_path / "other")) as rd:
        assert [it.rollout.rollout_id for it in read_n(rd, 1, timeout_s=3)] == [small.rollout_id]
    assert metrics.value("rlstream_dlq_records_total", field="claim_check") == dlq_before + 2
    dlq = read_topic_raw(kafka, kafka.topics.dlq, 2)
    reasons = [dict(m.headers)[H_REASON].decode() for m in dlq]
    assert len(reasons) == 2 and "sha256" in reasons[0] and "not found" in reasons[1]

    # a link planted where the blob belongs (to the right bytes, elsewhere) is not followed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(full)
    blob.symlink_to(elsewhere)
    with RolloutReader(kafka, blobs=BlobStore(tmp_path / "blobs")) as rd:
        assert [it.rollout.rollout_id for it in read_n(rd, 1, timeout_s=3)] == [small.rollout_id]
    assert metrics.value("rlstream_dlq_records_total", field="claim_check") == dlq_before + 3
    assert "link" in dict(read_topic_raw(kafka, kafka.topics.dlq, 3)[-1].headers)[H_REASON].decode()


@pytest.mark.timeout(30)
def test_blob_store_atomic_content_addressed(tmp_path):
    s = BlobStore(tmp_path)
    uri, sha, n = s.put(b"hello")
    assert uri.startswith("file://") and uri.endswith(sha) and n == 5
    assert s.put(b"hello") == (uri, sha, n)
    assert s.get(uri, sha, n) == b"hello"
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    for bad_uri, bad_sha, bad_n in [(uri, sha, 6), ("file:///etc/passwd", sha, 5), ("s3://b/" + sha, sha, 5),
                                    (uri, "0" * 64, 5), (uri, "zz", 5)]:
        with pytest.raises(InvalidRecordError) as e:
            s.get(bad_uri, bad_sha, bad_n)
        assert e.value.field == "claim_check"
    # a store mounted elsewhere finds the blob by digest
    other = BlobStore(tmp_path)
    assert other.get("file:///mnt/elsewhere/" + sha[:2] + "/" + sha, sha, 5) == b"hello"


# ---------------------------------------------------------------------- DLQ

@pytest.mark.broker
@pytest.mark.timeout(120)
def test_invalid_records_go_to_dlq_with_reason(kafka_settings):
    good = [realistic_rollout(response_tokens=16, prompt_tokens=4, layers=2, seed=200 + i, group_id="gd",
                              sample_idx=i) for i in range(3)]
    wrong_key = realistic_rollout(response_tokens=16, prompt_tokens=4, layers=2, seed=300, group_id="gk")
    m = msgpack.unpackb(encode(good[0]))
    m["logprobs"] = np.full(16, 0.5, np.float32).tobytes()
    bad_logprob = msgpack.packb(m)
    before = {f: metrics.value("rlstream_dlq_records_total", field=f) for f in ("<bytes>", "key", "logprobs")}
    with RolloutPublisher(kafka_settings) as pub:
        pub.publish(good[0]).result(10)
        pub.publish_bytes(b"gd", b"\x00garbage", headers=[("trace", b"abc")]).result(10)
        pub.publish(good[1]).result(10)
        pub.publish_bytes(b"not-gk", encode(wrong_key)).result(10)
        pub.publish_bytes(b"gd", bad_logprob).result(10)
        pub.publish(good[2]).result(10)
    with RolloutReader(kafka_settings) as rd:
        items = read_n(rd, 3)
        assert [it.rollout.rollout_id for it in items] == [r.rollout_id for r in good]
        assert len(rd.take_dead()) == 3 and rd.take_dead() == []
        pos = rd.positions()
    assert sum(pos.values()) == 6
    for f in before:
        assert metrics.value("rlstream_dlq_records_total", field=f) == before[f] + 1, f
    dlq = read_topic_raw(kafka_settings, kafka_settings.topics.dlq, 3)
    assert len(dlq) == 3
    by_field = {dict(x.headers)[H_FIELD].decode(): x for x in dlq}
    assert set(by_field) == {"<bytes>", "key", "logprobs"}
    g = by_field["<bytes>"]
    h = dict(g.headers)
    assert g.value == b"\x00garbage" and g.key == b"gd" and h["trace"] == b"abc"
    assert h[H_REASON] and h[H_SOURCE].decode().startswith(kafka_settings.topics.rollouts + "/")
    assert by_field["key"].value == encode(wrong_key)
    assert "must be in [-1000, 0]" in dict(by_field["logprobs"].headers)[H_REASON].decode()


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_records_the_consumer_refuses_go_to_dlq_with_reason(kafka_settings):
    """Valid records that do not fit the reader's consumer (the limits and `check` hook of
    consumer/stream/intake.py), and a record with a repeated key, are dead letters with their field."""
    from rlstream.consumer.stream.intake import VersionBound

    def rec(seed, **kw):
        return realistic_rollout(response_tokens=8, prompt_tokens=4, layers=2, seed=seed, group_id="gc",
                                 group_size=4, vocab=64, **kw)
    good = rec(500, policy_version=3)
    future = rec(501, policy_version=1003, sample_idx=1)  # "trainer + 1000"
    other_g = realistic_rollout(response_tokens=8, prompt_tokens=4, layers=2, seed=502, group_id="gc",
                                group_size=8, vocab=64)
    too_long = realistic_rollout(response_tokens=8, prompt_tokens=600, layers=2, seed=503, group_id="gc",
                                 group_size=4, vocab=64, sample_idx=2)
    pairs = list(msgpack.unpackb(encode(rec(504, sample_idx=3))).items()) + [("reward", 5.0)]
    pk = msgpack.Packer(use_bin_type=True)
    repeated = pk.pack_map_header(len(pairs)) + b"".join(pk.pack(k) + pk.pack(v) for k, v in pairs)
    fields = ("policy_version", "group_size", "prompt_ids", "reward")
    before = {f: metrics.value("rlstream_dlq_records_total", field=f) for f in fields}
    with RolloutPublisher(kafka_settings) as pub:
        for r in (good, future, other_g, too_long):
            pub.publish(r).result(10)
        pub.publish_bytes(b"gc", repeated).result(10)
    from rlstream.common.record import RecordLimits

    limits = RecordLimits(max_token_id=63, max_sequence_tokens=512, group_size=4)
    with RolloutReader(kafka_settings, limits=limits, check=VersionBound(lambda: 4)) as rd:
        items = read_n(rd, 1)
        time.sleep(0.5)
        items += rd.poll(timeout_s=0.5)
        assert [it.rollout.rollout_id for it in items] == [good.rollout_id]
        assert len(rd.take_dead()) == 4 and sum(rd.positions().values()) == 5
    for f in fields:
        assert metrics.value("rlstream_dlq_records_total", field=f) == before[f] + 1, f
    dlq = read_topic_raw(kafka_settings, kafka_settings.topics.dlq, 4)
    reasons = {dict(x.headers)[H_FIELD].decode(): dict(x.headers)[H_REASON].decode() for x in dlq}
    assert set(reasons) == set(fields)
    assert "future" in reasons["policy_version"] and "consumer.group_size 4" in reasons["group_size"]
    assert "512 positions" in reasons["prompt_ids"] and "twice" in reasons["reward"]


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_delivery_guarantee_positions_cover_returned_or_dead_lettered(kafka_settings):
    """The reader's docstring statement, checked after every poll, then resumed from positions()."""
    kafka = kafka_settings
    rng = np.random.default_rng(0)
    expected_valid, sent = set(), 0
    with RolloutPublisher(kafka) as pub:
        for i in range(60):
            r = realistic_rollout(response_tokens=8, prompt_tokens=4, layers=2, seed=400 + i, group_id=f"q{i % 6}",
                                  sample_idx=i // 6, group_size=10)
            if rng.random() < 0.3:
                pub.publish_bytes(r.group_id.encode(), os.urandom(int(rng.integers(0, 64)))).result(10)
            else:
                pub.publish(r).result(10)
                expected_valid.add(r.rollout_id)
            sent += 1
    returned: dict[tuple[int, int], str] = {}
    mid = None
    with RolloutReader(kafka) as rd:
        start = rd.positions()
        for _ in range(200):
            for it in rd.poll(max_records=5, timeout_s=0.3):
                returned[(it.partition, it.offset)] = it.rollout.rollout_id
            pos = rd.positions()
            dead_n = rd.dlq_total
            dlq = read_topic_raw(kafka, kafka.topics.dlq, dead_n, timeout_s=5) if dead_n else []
            dead = {tuple(map(int, dict(m.headers)[H_SOURCE].decode().rsplit("/", 2)[1:])) for m in dlq}
            covered = {(p, o) for p in pos for o in range(start[p], pos[p])}
            assert covered == set(returned) | dead, "positions() must cover exactly returned + DLQ'd offsets"
            assert not set(returned) & dead
            if sum(pos.values()) == sent:
                break
            if len(returned) > 20 and mid is None:
                mid = pos  # a checkpoint taken mid-stream
        assert sum(rd.positions().values()) == sent
    assert set(returned.values()) == expected_valid and mid is not None
    # resuming from a checkpointed positions() returns exactly the records after it
    with RolloutReader(kafka, start_offsets=mid) as rd2:
        again = read_n(rd2, sum(1 for (p, o) in returned if o >= mid[p]), timeout_s=10)
        assert rd2.poll(timeout_s=0.3) == []
    assert sorted((it.partition, it.offset) for it in again) == sorted(k for k in returned if k[1] >= mid[k[0]])


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_dlq_failure_keeps_positions(broker, tmp_path):
    """If the DLQ send fails, poll raises and positions() does not move past the invalid record."""
    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "b", request_timeout_ms=1000)
    bad_dlq = kafka.model_copy(update={"topics": kafka.topics.model_copy(update={"dlq": "bad topic name!"})})
    good = realistic_rollout(response_tokens=8, prompt_tokens=4, layers=2, seed=1, group_id="x")
    with RolloutPublisher(kafka) as pub:
        pub.publish(good).result(10)
        d = pub.publish_bytes(b"x", b"junk").result(10)
    with RolloutReader(bad_dlq, partitions=[d.partition]) as rd:
        start = rd.positions()
        for _ in range(2):
            with pytest.raises(BrokerError):
                read_n(rd, 5, timeout_s=5)
            assert rd.positions() == start
    with RolloutReader(kafka, partitions=[d.partition]) as rd:
        assert [it.rollout.rollout_id for it in read_n(rd, 1)] == [good.rollout_id]
        read_n(rd, 5, timeout_s=1)
        assert rd.positions() == {d.partition: d.offset + 1} and rd.dlq_total == 1


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_offsets_naming_unassigned_partitions_or_negative_are_refused(kafka_settings):
    with pytest.raises(OffsetError, match=r"partition\(s\) \[7\].*assigned \[0, 1\]"):
        RolloutReader(kafka_settings, partitions=[0, 1], start_offsets={0: 0, 7: 3})
    with RolloutReader(kafka_settings, partitions=[0, 1]) as rd:
        with pytest.raises(OffsetError, match=r"partition\(s\) \[2\]"):
            rd.seek({2: 0})
        with pytest.raises(OffsetError, match="must be >= 0"):
            rd.seek({1: -1})
        assert rd.positions() == {0: 0, 1: 0}


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_dead_letter_writer_stores_the_original_with_reason_headers(kafka_settings):
    """The shared DLQ writer (reader and prompt topic) on its own: confirm() returns once both are stored."""
    from types import SimpleNamespace

    refused = [SimpleNamespace(topic="src", partition=3, offset=17, key=b"k1", value=b"\x00raw",
                               headers=[("trace", b"t1")]),
               SimpleNamespace(topic="src", partition=0, offset=2, key=None, value=None, headers=None)]
    w = DeadLetterWriter(kafka_settings)
    try:
        w.send(refused[0], "logprobs", "must be <= 0")
        w.send(refused[1], "<bytes>", "empty message")
        assert w.confirm() == 2
    finally:
        w.close()
    got = read_topic_raw(kafka_settings, kafka_settings.topics.dlq, 2)
    assert [(m.key, m.value) for m in got] == [(b"k1", b"\x00raw"), (None, b"")]
    assert [list(m.headers) for m in got] == [
        [("trace", b"t1"), (H_REASON, b"must be <= 0"), (H_FIELD, b"logprobs"), (H_SOURCE, b"src/3/17")],
        [(H_REASON, b"empty message"), (H_FIELD, b"<bytes>"), (H_SOURCE, b"src/0/2")]]


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_end_offsets_count_every_record_of_a_multi_record_batch(kafka_settings):
    """13 records of one key published in one linger window (one batch on one partition): a reader that
    fetched reports all 13 (fetch high watermark); ListOffsets from a client that never fetched is only
    a lower bound on tansu (measured 9 for 13: the last batch's base offset + 1)."""
    from kafka import TopicPartition

    rs = [realistic_rollout(response_tokens=8, prompt_tokens=4, layers=2, seed=900 + i, group_id="batch",
                            sample_idx=i, group_size=13) for i in range(13)]
    with RolloutPublisher(kafka_settings, linger_ms=300) as pub:
        deliveries = [f.result(30) for f in [pub.publish(r) for r in rs]]
    (p,) = {d.partition for d in deliveries}
    assert sorted(d.offset for d in deliveries) == list(range(13))
    c = make_consumer(kafka_settings)
    try:
        listed = end_offsets(c, [TopicPartition(kafka_settings.topics.rollouts, p)], timeout_ms=5000)[p]
    finally:
        c.close()
    with RolloutReader(kafka_settings, partitions=[p]) as rd:
        assert len(read_n(rd, 13)) == 13
        assert rd.end_offsets() == {p: 13} and rd.lag() == 0
    print(f"ListOffsets(latest) answered {listed} for 13 records")
    assert 1 <= listed <= 13


# ------------------------------------------------------------ admin, broker

@pytest.mark.broker
@pytest.mark.timeout(60)
def test_ensure_topics_idempotent(broker, tmp_path):
    kafka = make_kafka_settings(broker.bootstrap, tmp_path, create=False, rollouts_partitions=3)
    first = ensure_topics(kafka)
    assert set(first.values()) == {"created"} and len(first) == 4  # rollouts, policy, control, dlq
    assert set(ensure_topics(kafka).values()) == {"exists"}
    c = make_consumer(kafka)
    try:
        assert c.partitions_for_topic(kafka.topics.rollouts) == {0, 1, 2}
        assert c.partitions_for_topic(kafka.topics.control) == {0}
    finally:
        c.close()


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_embedded_broker_lifecycle():
    b = EmbeddedBroker(BrokerSettings(port=0)).start()
    host, port = b.bootstrap.split(":")
    assert kafka_ping(host, int(port))
    # a second broker on the same port is refused (tansu itself would share it: SO_REUSEPORT)
    with pytest.raises(BrokerError, match="already in use"):
        EmbeddedBroker(BrokerSettings(port=int(port), start_timeout_s=5)).start()
    assert b.stop() == 0
    assert not kafka_ping(host, int(port), timeout_s=0.3)
    bs, none = ensure_broker(KafkaSettings(bootstrap_servers="kafka:9092"), BrokerSettings())
    assert (bs, none) == ("kafka:9092", None)
    bs, started = ensure_broker(KafkaSettings(), BrokerSettings(port=0))
    try:
        assert started is not None and bs == started.bootstrap and kafka_ping(*bs.split(":")[:1], int(bs.split(":")[1]))
    finally:
        started.stop()


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_run_broker_forever_stops_cleanly_on_sigterm(tmp_path):
    """`rlstream broker` (run_broker_forever): it creates the topics, says where it listens,
    and exits 0 on SIGTERM with the broker stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "broker.yaml"
    config.write_text("{}\n")
    with Service("broker", config, tmp_path, sets=[f"broker.port={port}"]).start() as broker:
        line = wait_until(lambda: next((x for x in broker.log_text().splitlines() if "listening on" in x), None),
                          20, "the broker to listen", [broker])
        assert f"127.0.0.1:{port}" in line
        kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}")
        assert set(ensure_topics(kafka).values()) == {"exists"}  # `rlstream broker` created them
        assert broker.stop(timeout_s=15) == 0, broker.log_tail()
        assert not kafka_ping("127.0.0.1", port, timeout_s=0.3)


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_a_topic_kept_busy_is_read_back_to_its_end_in_bounded_time(kafka_settings):
    """ops/harness/census.py read_rollouts(to_end=True): a topic a running service keeps
    writing is never quiet, and the read until quiet took its whole timeout (60 s, twice per
    check in test_faults_producer and test_weight_elastic). Every record acknowledged before
    the read is in it (here one multi-record batch, of which tansu's ListOffsets counts one)."""
    import threading

    from rlstream.harness.census import read_rollouts

    def small(seed: int, **kw):
        return realistic_rollout(response_tokens=16, prompt_tokens=8, layers=2, seed=seed, **kw)

    with RolloutPublisher(kafka_settings, linger_ms=300) as pub:
        first = [small(i, group_id="one-batch", sample_idx=i, group_size=13) for i in range(13)]
        for f in [pub.publish(r) for r in first]:
            f.result(30)
        busy = threading.Event()

        def keep_writing():  # the running producer: a record every 0.2 s
            i = 100
            while not busy.wait(0.2):
                pub.publish(small(i))
                pub.flush()
                i += 1
        writer = threading.Thread(target=keep_writing, daemon=True)
        writer.start()
        try:
            t0 = time.monotonic()
            got = read_rollouts(kafka_settings, quiet_s=1.0, timeout_s=30, to_end=True)
            seconds = time.monotonic() - t0
        finally:
            busy.set()
            writer.join(5)
    assert {r.rollout_id for r in first} <= set(got), "a record acknowledged before the read is missing"
    assert seconds < 10, f"read {len(got)} records in {seconds:.1f} s: the read waited for quiet"
