"""The broker as the services see it over hours and in an outage, on the real tansu.

- A long log: tansu lists a partition's whole log on every fetch and gives up
  when the fetch's wait runs out (common/kafka/fetch_wait.py), so a consumer
  whose wait is shorter than that listing reads nothing while records wait.
  The partition here is long in batches, not in hours: one-record produce
  requests written back to back (tests/support/topics.py `append_batches`),
  and the readers start with a short wait (the reader 5 ms on 15,000 batches, a
  control follower 1 ms on 1,500; the consumer's reader starts at 20 ms, and the
  listing's cost per batch is the same, so 15,000 batches starve a 5 ms wait as
  ~60,000 starve 20 ms: the issue's consumer, after about two hours).
- A frozen broker (SIGSTOP, sockets open): readiness says the broker does not
  answer, with a reason and `rlstream_dependency_up{dependency="broker"}` 0,
  while liveness (the loop's own progress) is not its business; it clears
  after SIGCONT. The broker is the test's own, not the session's.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from rlstream.common import metrics
from rlstream.common.control.http import ServiceHttp
from rlstream.common.control.liveness import Readiness
from rlstream.harness.observe import http_request
from rlstream.common.kafka.publisher import RolloutPublisher
from rlstream.common.kafka.reader import RolloutReader
from tests.fixtures.kafka import make_kafka_settings
from tests.support.synthetic import publish_groups, synthetic_group
from tests.support.topics import append_batches

pytestmark = [pytest.mark.broker]

LONG_LOG_BATCHES = 15_000
FLOOR_MS = 5
EMPTY_POLLS = 40
"""Polls in a row that return nothing before a reader counts as starved (each waits 0.5 s at most)."""


@pytest.mark.timeout(180)
def test_a_reader_gets_the_records_behind_a_long_log(broker, tmp_path):
    """On c99ceb0 every poll came back empty (the wait never changed): the records below were
    never read. Now the empty fetches raise the wait until tansu lists the log in time."""
    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=1)
    append_batches(broker.bootstrap, kafka.topics.rollouts, 0, LONG_LOG_BATCHES)
    group = synthetic_group("after-the-long-log", 4, 0, np.random.default_rng(0))
    with RolloutPublisher(kafka) as pub:
        ids = publish_groups(pub, [group])
    raised0 = metrics.value("rlstream_fetch_wait_raised_total", consumer="rollouts")
    with RolloutReader(kafka, start_offsets={0: LONG_LOG_BATCHES}, fetch_max_wait_ms=FLOOR_MS) as rd:
        got, empty = [], 0
        while len(got) < len(ids) and empty < EMPTY_POLLS:  # the wait doubles once per empty fetch answer
            items = rd.poll(max_records=64, timeout_s=0.5)
            got, empty = got + items, 0 if items else empty + 1
        assert sorted(it.rollout.rollout_id for it in got) == sorted(ids), (rd.fetch_wait.ms, len(got))
        assert rd.fetch_wait.ms > FLOOR_MS and rd.fetch_wait.raised >= 1
        assert metrics.value("rlstream_fetch_wait_raised_total", consumer="rollouts") - raised0 == rd.fetch_wait.raised
        assert metrics.value("rlstream_fetch_wait_seconds", consumer="rollouts") == rd.fetch_wait.ms / 1000
        assert rd.positions() == {0: LONG_LOG_BATCHES + len(ids)} and rd.dlq_total == 0


@pytest.mark.timeout(180)
def test_the_control_follower_gets_an_announcement_behind_a_long_policy_log(broker, tmp_path):
    """The producers' view of the trainer: after hours of TrainerProgress messages the policy
    topic is long; a new WeightsReady must still arrive."""
    from rlstream.common.config import ControlSettings
    from rlstream.common.control.messages import TrainerProgress, WeightsReady
    from rlstream.common.control.plane import ControlFollower, ControlPlaneWriter

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs")
    # 1 ms: tansu lists a partition's whole log per fetch (~1 us a batch on the 2-core machine), so
    # 3,000 batches take about 3 times the wait to list (a machine would need to be 3 times faster); with
    # 1,500 a fast run listed them within the wait, the wait was never raised and the test failed
    follower = ControlFollower(kafka, ControlSettings(), fetch_wait_ms=1)
    try:
        follower.catch_up()
        progress = TrainerProgress(trainer_version=0, groups_per_batch=2, group_size=4)
        append_batches(broker.bootstrap, kafka.topics.policy, 0, 3_000, value=progress.model_dump_json().encode())
        writer = ControlPlaneWriter(kafka)
        try:
            writer.announce(WeightsReady(version=7, transport="file", uri="file:///w/v7", sha256="a" * 64, bytes=1))
        finally:
            writer.close()
        empty = 0
        while follower.view.weights is None and empty < EMPTY_POLLS:  # progress messages first, in order
            empty = 0 if follower.poll(timeout_s=0.5) else empty + 1
        assert follower.view.weights is not None and follower.view.weights.version == 7, follower.fetch_wait.ms
        assert follower.fetch_wait.raised >= 1, follower.fetch_wait.ms
    finally:
        follower.close()


def _get(url: str) -> tuple[int, dict]:
    code, body = http_request(url)
    return code, json.loads(body)


@pytest.mark.timeout(120)
def test_a_frozen_broker_makes_a_service_unready_and_its_return_ready(fresh_broker, tmp_path):
    """On c99ceb0 /readyz answered 200 throughout: readiness only opened a TCP connection,
    which the kernel completes for a SIGSTOPped broker."""
    kafka = make_kafka_settings(fresh_broker.bootstrap, tmp_path / "blobs", create=False)
    ready = Readiness(kafka, timeout_s=0.5, probe_every_s=0.2)
    http = ServiceHttp("127.0.0.1", 0, lambda: (True, {}), ready=lambda: ready.check({"step": 3})).start()
    try:
        ready.initialised()
        assert _get(http.url + "/readyz") == (200, {"status": "ready", "step": 3})
        assert metrics.value("rlstream_dependency_up", dependency="broker") == 1.0
        fresh_broker.pause()
        try:
            for _ in range(100):  # a probe every 0.2 s, each answered within 0.5 s
                code, body = _get(http.url + "/readyz")
                if code == 503:
                    break
                time.sleep(0.1)
            assert code == 503, body
            assert "answered no Kafka request" in body["reasons"][0] and fresh_broker.bootstrap in body["reasons"][0]
            assert metrics.value("rlstream_dependency_up", dependency="broker") == 0.0
            assert metrics.value("rlstream_ready") == 0.0
            assert _get(http.url + "/healthz")[0] == 200  # liveness is the loop's, not the broker's
        finally:
            fresh_broker.resume()
        for _ in range(100):
            code, body = _get(http.url + "/readyz")
            if code == 200:
                break
            time.sleep(0.1)
        assert (code, body) == (200, {"status": "ready", "step": 3})
        assert metrics.value("rlstream_dependency_up", dependency="broker") == 1.0
    finally:
        ready.close()
        http.stop()
