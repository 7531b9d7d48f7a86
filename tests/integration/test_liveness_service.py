"""Liveness and readiness of the real consumer (real broker, real Megatron-core, tiny model).

- once started it is ready (/readyz 200: model built, broker reachable) and live;
- a full batch on the topic and a train step that hangs (the trainer ranks
  stuck in a collective; the test blocks the leader's call): /healthz turns
  503 within `consumer.liveness.stall_after_s` with the reason, and `rlstream_live`
  drops to 0 on /metrics meanwhile; when the step completes it is live again;
- on stop it is no longer ready, while still live.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from rlstream.common.config import RlstreamConfig
from tests.fixtures.kafka import make_kafka_settings
from tests.support.synthetic import publish_groups, synthetic_group

pytestmark = [pytest.mark.broker, pytest.mark.megatron]

G, B, STALL_S = 2, 2, 3.0


def get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if body.startswith("{") else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def live_metric(url: str) -> float:
    line = next(ln for ln in get(url + "/metrics")[1].splitlines() if ln.startswith("rlstream_live "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def service(broker, tiny_model_dir, tmp_path_factory):
    from rlstream.common.kafka.publisher import RolloutPublisher
    from rlstream.consumer.service import ConsumerService

    tmp = tmp_path_factory.mktemp("liveness")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=1)
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "producer": {"group_size": G},
        "consumer": {"group_size": G, "groups_per_batch": B, "checkpoint_dir": str(tmp / "ckpt"),
                     "weight_store_dir": str(tmp / "weights"), "liveness": {"stall_after_s": STALL_S}}})
    svc = ConsumerService(cfg, broker.bootstrap)
    svc.start()
    pub = RolloutPublisher(kafka)
    yield svc, pub
    pub.close()
    svc.close()


@pytest.mark.timeout(300)
def test_a_hung_train_step_with_a_full_batch_turns_healthz_503_within_the_bound(service):
    svc, pub = service
    url = svc.http.url
    assert get(url + "/readyz")[0] == 200 and get(url + "/healthz")[0] == 200 and live_metric(url) == 1.0

    train, entered, release = svc.leader.train, threading.Event(), threading.Event()

    def hung_train(samples):  # rank 0 waits in a collective a dead follower never joins
        entered.set()
        release.wait(120)
        return train(samples)

    svc.leader.train = hung_train
    publish_groups(pub, [synthetic_group(f"g{i}", G, svc.version, np.random.default_rng(i)) for i in range(B)])
    loop = threading.Thread(target=lambda: svc.train_step(svc.next_batch()), daemon=True)
    loop.start()
    try:
        assert entered.wait(120), "the batch was not assembled"
        t0 = time.monotonic()
        while (answer := get(url + "/healthz"))[0] == 200 and time.monotonic() - t0 < STALL_S + 10:
            time.sleep(0.2)
        code, body = answer
        assert code == 503, f"/healthz still 200 {time.monotonic() - t0:.1f} s into a hung step (bound {STALL_S} s)"
        assert body["reasons"][0].startswith("train_step has had work for") and live_metric(url) == 0.0
        assert get(url + "/readyz")[0] == 200  # wedged is not unready: the probe that restarts is liveness
    finally:
        release.set()
        loop.join(120)
        svc.leader.train = train
    assert svc.step == 1 and get(url + "/healthz")[0] == 200 and live_metric(url) == 1.0


@pytest.mark.timeout(60)
def test_a_stopping_consumer_is_not_ready_but_live(service):
    svc, _ = service
    svc.stop()
    code, body = get(svc.http.url + "/readyz")
    assert code == 503 and body["reasons"] == ["stopping"]
    assert get(svc.http.url + "/healthz")[0] == 200
