"""common/control/liveness.py: liveness is progress, readiness is separate.

The monitor's rules on a fake clock; then /healthz and /readyz over the real
HTTP endpoint; then the two services' own loop pieces (no engine, no broker,
no Megatron: fakes stand in for them) wedged while work waits: /healthz must
turn 503 within the configured bound, with the reason.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest

from rlstream.common import metrics
from rlstream.common.config import ControlSettings, RlstreamConfig
from rlstream.common.control.http import ServiceHttp
from rlstream.common.control.liveness import ProgressMonitor, Readiness, broker_reachable
from rlstream.common.record import Rollout
from tests.support.fakes import Clock


@pytest.fixture
def clock():
    return Clock(1000.0)


def monitor(clock, stall_after_s=10.0) -> ProgressMonitor:
    return ProgressMonitor(stall_after_s, clock=clock, export=False)


# ----------------------------------------------------------------- the rules

def test_an_activity_with_work_and_no_progress_is_not_live_after_the_bound(clock):
    m = monitor(clock)
    m.has_work("train_step", True)
    clock.t += 10.0
    assert m.check() == (True, [])  # at the bound: still live
    clock.t += 0.5
    live, reasons = m.check()
    assert not live and reasons == ["train_step has had work for 10 s without progress (stall_after_s 10)"]


def test_beats_keep_it_live_and_idle_is_never_stalled(clock):
    m = monitor(clock)
    m.has_work("engine_step", True)
    for _ in range(5):
        clock.t += 8.0
        m.beat("engine_step")
        assert m.check()[0]
    m.has_work("engine_step", False)
    clock.t += 3600.0  # idle for an hour: no data, paused, held back
    assert m.check()[0]
    assert m.seconds_since_progress("engine_step") == 0.0


def test_the_stall_clock_starts_when_work_arrives_not_at_the_last_beat(clock):
    m = monitor(clock)
    m.beat("train_step")
    clock.t += 3600.0  # the last step was an hour ago; data only arrives now
    m.has_work("train_step", True)
    clock.t += 9.0
    assert m.check()[0]
    assert m.seconds_since_progress("train_step") == 9.0
    m.has_work("train_step", True)  # still waiting: the clock is not restarted
    clock.t += 2.0
    assert not m.check()[0]


def test_a_bounded_operation_past_its_limit_is_not_live_and_its_time_is_not_a_stall(clock):
    m = monitor(clock)
    m.has_work("engine_step", True)
    m.started("weight_update", limit_s=60.0)
    clock.t += 50.0  # longer than stall_after_s, within the operation's limit
    assert m.check() == (True, [])
    assert m.seconds_since_progress("weight_update") == 50.0
    clock.t += 20.0
    live, reasons = m.check()
    assert not live and reasons == ["weight_update has run 70 s, limit 60 s"]
    m.ended("weight_update")
    assert m.check()[0]  # the 70 s in the operation do not count for engine_step
    clock.t += 10.5
    assert m.check()[1] == ["engine_step has had work for 10 s without progress (stall_after_s 10)"]


def test_operation_context_ends_also_when_the_block_raises(clock):
    m = monitor(clock)
    with pytest.raises(RuntimeError):
        with m.operation("weight_update", limit_s=1.0):
            raise RuntimeError("load failed")
    clock.t += 5.0
    assert m.check()[0]


def test_health_details_carry_the_reasons_only_when_not_live(clock):
    m = monitor(clock)
    assert m.health({"version": 3}) == (True, {"version": 3})
    m.has_work("train_step", True)
    clock.t += 11.0
    live, details = m.health({"version": 3})
    assert not live and details["version"] == 3 and "train_step" in details["reasons"][0]


def test_a_change_of_liveness_is_logged_once_not_per_probe(clock, caplog):
    caplog.set_level(logging.INFO, logger="rlstream.common.control.liveness")
    m = monitor(clock)
    m.has_work("train_step", True)
    clock.t += 11.0
    for _ in range(3):
        m.check()
    m.beat("train_step")
    m.check()
    assert [(r.levelname, r.getMessage()[:21]) for r in caplog.records if r.name == "rlstream.common.control.liveness"] == [
        ("ERROR", "liveness: train_step "), ("INFO", "liveness: live again")]


def test_stall_after_s_must_be_positive():
    with pytest.raises(ValueError):
        ProgressMonitor(0)


def test_settings_have_documented_defaults():
    cfg = RlstreamConfig()
    assert cfg.consumer.liveness.stall_after_s == 1800.0
    assert cfg.producer.liveness.stall_after_s == 300.0 and cfg.producer.liveness.weight_update_limit_s == 900.0


def test_metrics_are_evaluated_at_scrape_time(clock):
    m = ProgressMonitor(10.0, clock=clock)  # exported: the process's newest monitor
    m.has_work("liveness_test", True)
    clock.t += 4.0
    assert metrics.value("rlstream_loop_seconds_since_progress", activity="liveness_test") == 4.0
    assert metrics.value("rlstream_live") == 1.0
    clock.t += 7.0  # nothing called the monitor: the scrape alone sees the stall
    assert metrics.value("rlstream_live") == 0.0
    m.beat("liveness_test")
    assert metrics.value("rlstream_live") == 1.0


# ----------------------------------------------------------------- readiness

class ApiVersionsServer:
    """A socket that answers each connection's ApiVersions request as a Kafka broker does
    (`answer`), or accepts and stays silent (a frozen broker: the kernel accepts for it)."""

    def __init__(self, answer: bool):
        import struct

        self.srv = socket.create_server(("127.0.0.1", 0))
        self.bootstrap = f"127.0.0.1:{self.srv.getsockname()[1]}"
        body = struct.pack(">ihi", 0x5EED, 0, 1) + struct.pack(">hhh", 18, 0, 3)  # correlation id, no error, 1 api
        self._reply = struct.pack(">i", len(body)) + body if answer else b""
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self._held.append(c)
            if self._reply:
                c.recv(1024)
                c.sendall(self._reply)

    def close(self) -> None:
        self.srv.close()
        for c in self._held:
            c.close()


def test_readiness_needs_initialised_a_broker_that_answers_every_check_and_not_stopping():
    up, silent = ApiVersionsServer(answer=True), ApiVersionsServer(answer=False)
    problems: list[str] = []
    try:
        r = Readiness(f"PLAINTEXT://127.0.0.1:1, {up.bootstrap}", timeout_s=0.5, export=False)  # any server will do
        r.add_check(lambda: list(problems))
        assert r.check() == (False, {"reasons": ["initialising"]})
        r.initialised()
        assert r.check({"v": 1}) == (True, {"v": 1})
        problems.append("intake starved")
        assert r.check() == (False, {"reasons": ["intake starved"]})
        r.stopping()
        assert r.check() == (False, {"reasons": ["stopping"]})
        for bootstrap, why in ((silent.bootstrap, "accepts connections but answered no Kafka request within 0.5 s"),
                               ("127.0.0.1:1", "does not accept connections")):
            down = Readiness(bootstrap, timeout_s=0.5, export=False)
            down.initialised()
            ok, details = down.check()
            down.close()
            assert not ok and details["reasons"][0].startswith(f"broker unreachable: {bootstrap} {why}"), details
        assert broker_reachable(up.bootstrap) and not broker_reachable(silent.bootstrap, 0.5)
        assert not broker_reachable("nonsense")
    finally:
        up.close()
        silent.close()


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_healthz_and_readyz_are_separate_routes(clock):
    m, r = monitor(clock), Readiness("127.0.0.1:1")
    http = ServiceHttp("127.0.0.1", 0, lambda: m.health({"version": 7}), ready=lambda: r.check({"version": 7})).start()
    try:
        assert get(http.url + "/healthz") == (200, {"status": "ok", "version": 7})
        assert get(http.url + "/readyz") == (503, {"status": "not ready", "version": 7, "reasons": ["initialising"]})
        m.has_work("train_step", True)
        clock.t += 11.0
        code, body = get(http.url + "/healthz")
        assert code == 503 and body["status"] == "unhealthy" and "train_step" in body["reasons"][0]
    finally:
        http.stop()


# ----------------------------------------------------------------- the services, wedged

STALL_S = 2.0


def wait_for_503(url: str, within_s: float) -> tuple[float, dict]:
    """Seconds until GET `url` answered 503 (and its body); fails after `within_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        code, body = get(url)
        if code == 503:
            return time.monotonic() - t0, body
        time.sleep(0.1)
    pytest.fail(f"{url} still 200 after {within_s} s: a wedged loop would never be restarted")


def rollout(group: str, idx: int, reward: float) -> Rollout:
    return Rollout(rollout_id=f"{group}-{idx}", group_id=group, sample_idx=idx, group_size=2,
                   prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3], np.int32),
                   logprobs=np.array([-0.5], np.float32), policy_version=0, reward=reward)


class WedgedLeader:
    """The trainer ranks, hung in a collective (a dead follower rank) until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.ckpt = SimpleNamespace(audit=lambda entry: None)

    def train(self, samples):
        self.entered.set()
        self.release.wait(60)
        return {}


def test_consumer_with_a_full_batch_and_a_hung_train_step_turns_unhealthy():
    from rlstream.consumer.train import batch
    from rlstream.consumer.service import ConsumerService

    cfg = RlstreamConfig.model_validate({"producer": {"group_size": 2},
                                         "consumer": {"group_size": 2, "groups_per_batch": 2,
                                                      "liveness": {"stall_after_s": STALL_S}}})
    svc = ConsumerService(cfg, "127.0.0.1:1")
    svc.follower = SimpleNamespace(catch_up=lambda: [], poll=lambda: [], view=SimpleNamespace(state=ControlSettings()))
    svc.leader = WedgedLeader()
    for g in ("g0", "g1"):  # two complete groups: a full batch waits
        svc.ledger.read([SimpleNamespace(partition=0, offset=2 * int(g[1]) + i, rollout=rollout(g, i, float(i)))
                         for i in range(2)])
    http = ServiceHttp("127.0.0.1", 0, svc._health).start()
    loop = threading.Thread(target=lambda: svc.train_step(svc.next_batch()), daemon=True)
    try:
        loop.start()
        assert svc.leader.entered.wait(30)
        assert get(http.url + "/healthz")[0] == 200  # within the bound: live
        took, body = wait_for_503(http.url + "/healthz", STALL_S + 5)
        assert "train_step has had work" in body["reasons"][0] and body["step"] == 0
    finally:
        svc.leader.release.set()
        loop.join(10)
        http.stop()


class Engine:
    """RolloutEngine's loop-facing surface; `step` hangs once `wedge` is set (a worker stuck in NCCL)."""

    version, num_in_flight, weight_transfer = 0, 3, None

    def __init__(self):
        self.steps, self.wedge, self.entered = 0, threading.Event(), threading.Event()

    def has_work(self):
        return True

    def oldest_versions(self):  # stale eviction (producer/eviction.py): nothing in flight is stale here
        return {}

    def step(self):
        if self.wedge.is_set():
            self.entered.set()
            time.sleep(60)
        self.steps += 1
        time.sleep(0.005)
        return []


def producer_service(liveness: dict):
    from rlstream.producer.service import ProducerService

    cfg = RlstreamConfig.model_validate({"producer": {"liveness": liveness}})
    svc = ProducerService(cfg, "127.0.0.1:1")
    from rlstream.producer.following import Following
    from rlstream.producer.rollout.single_turn import SingleTurn

    svc.engine = Engine()
    svc.driver = SingleTurn(svc.engine, svc.groups, svc.sampling, svc.producer_id)
    svc.following = Following(SimpleNamespace(catch_up=lambda: [], poll=lambda: [], view=SimpleNamespace(
        weights=None, progress=None, state=ControlSettings())), group_size=2)
    svc.following.reloader = SimpleNamespace(tick=lambda: False, apply=lambda msg: False,
                                             state=lambda: {"state": "receiving", "serving_version": 0})
    svc.outbox = SimpleNamespace(pending=[], unacked_records=0, flush=lambda: None, add=lambda r: None)
    svc.topic_ends = SimpleNamespace(current=dict)
    svc.prompts = SimpleNamespace(take=lambda: None)
    return svc


def test_producer_with_requests_in_the_engine_and_no_engine_step_turns_unhealthy():
    svc = producer_service({"stall_after_s": STALL_S})
    http = ServiceHttp("127.0.0.1", 0, svc._health).start()

    def loop():
        while True:
            svc.iterate()

    worker = threading.Thread(target=loop, daemon=True)
    try:
        worker.start()
        time.sleep(STALL_S + 0.5)  # stepping: live past the bound
        assert get(http.url + "/healthz")[0] == 200 and svc.engine.steps > 0
        svc.engine.wedge.set()
        assert svc.engine.entered.wait(30)
        took, body = wait_for_503(http.url + "/healthz", STALL_S + 5)
        assert took > STALL_S - 1.0 and "engine_step has had work" in body["reasons"][0]
    finally:
        http.stop()


def test_producer_with_a_weight_transfer_that_does_not_end_turns_unhealthy():
    svc = producer_service({"stall_after_s": 60.0, "weight_update_limit_s": STALL_S})
    entered = threading.Event()

    def hung_tick():  # the link's receive, blocked in a collective the trainer never completes
        entered.set()
        time.sleep(60)

    svc.following.reloader.tick = hung_tick
    http = ServiceHttp("127.0.0.1", 0, svc._health).start()
    try:
        threading.Thread(target=svc.iterate, daemon=True).start()
        assert entered.wait(30)
        took, body = wait_for_503(http.url + "/healthz", STALL_S + 5)
        assert body["reasons"][0].startswith("weight_update has run")
        assert body["weights"] == {"state": "receiving", "serving_version": 0}  # the reloader's weight state
    finally:
        http.stop()
