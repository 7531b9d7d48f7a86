"""Operations against running services: Prometheus exposition and runtime control.

A real producer (vLLM CPU) and a real consumer (Megatron-core) run as
processes on the tiny model. The test scrapes both over HTTP and parses the
exposition with prometheus-client's parser: every metric docs/metrics.md
documents for that service is there. Then `max_staleness` is lowered through
the admin API while both run: both services report the new value, the
producer's staleness backpressure engages, and every batch the consumer
trains after the change is within the new bound (from its audit log and the
records read back from the topic). Last, `max_staleness auto` hands the bound to
the consumer's controller, which moves it (published with its reason, applied by
both services), until an operator's bound takes it back.
"""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from rlstream.harness.census import read_rollouts
from rlstream.harness.observe import http_request, parse
from rlstream.harness.supervisor import Service, wait_until
from tests.fixtures.kafka import make_kafka_settings
from tests.support.audit import audit_entries, audit_steps, step_staleness
from tests.support.configs import ADMIN_TOKEN, ensure_prompts, service_config, write_config

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def documented_metrics() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("metrics_docs", ROOT / "tests/unit/test_metrics_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parse_metric_table((ROOT / "docs/metrics.md").read_text())


def exposed_families(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    out = set()
    for fam in text_string_to_metric_families(text):
        out.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    return out


@pytest.fixture(scope="module")
def pipeline(broker, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    # `auto` (off at start): one step per decision and thresholds every step meets, so the
    # controller loosens by one per step once an operator hands it the bound
    auto = {"min": 0, "max": 6, "window": 1, "wait_share_loosen": 0.0, "ess_tighten": 0.01, "ess_loosen": 0.02,
            "kl_tighten": 10.0, "kl_loosen": 5.0, "grad_norm_tighten": 1000.0, "grad_norm_loosen": 999.0}
    cfg = service_config(kafka, tiny_model_dir, tmp, G=4, B=2, staleness={"max_staleness": 4, "auto": auto})
    ensure_prompts(cfg)
    path = write_config(cfg, tmp / "config.yaml")
    producer = Service("producer", path, tmp / "logs").start()
    consumer = Service("consumer", path, tmp / "logs").start()
    try:
        producer.wait_ready()
        consumer.wait_ready()
        yield producer, consumer, cfg
    finally:
        for s in (producer, consumer):
            if s.alive:
                assert s.stop(timeout_s=120) == 0, s.log_tail()


def steps(cfg) -> list[int]:
    """The consumer's trained global steps (its audit log)."""
    return sorted(audit_steps(Path(cfg.consumer.checkpoint_dir)))


@pytest.mark.timeout(400)
def test_every_documented_metric_is_exposed_by_its_service(pipeline):
    producer, consumer, cfg = pipeline
    wait_until(lambda: len(steps(cfg)) >= 2, 300, "two training steps", [producer, consumer])
    docs = documented_metrics()
    for svc in (producer, consumer):
        exposed = exposed_families(svc.scrape())
        want = {n for n, row in docs.items() if row["service"] in (svc.command, "both")}
        assert want and want <= exposed, f"{svc.command} does not expose {sorted(want - exposed)}"


@pytest.mark.timeout(400)
def test_lowering_max_staleness_at_runtime(pipeline):
    producer, consumer, cfg = pipeline
    wait_until(lambda: len(steps(cfg)) >= 3, 300, "three training steps", [producer, consumer])
    code, _ = http_request(producer.url + "/admin/control", "POST", {"key": "max_staleness", "value": 0})
    assert code == 401  # no token: refused, nothing changed
    assert producer.metric("rlstream_control_setting", key="max_staleness") == 4
    held0 = producer.metric("rlstream_producer_held_back_total", reason="staleness")
    code, body = http_request(producer.url + "/admin/control", "POST", {"key": "max_staleness", "value": 0},
                              token=ADMIN_TOKEN)
    assert code == 200, body
    changed_at = time.monotonic()
    for svc in (producer, consumer):  # both apply the change from the control topic
        wait_until(lambda: svc.metric("rlstream_control_setting", key="max_staleness") == 0, 60,
                   f"{svc.command} applying max_staleness=0", [producer, consumer])
    seen_at_step = max(steps(cfg))
    wait_until(lambda: max(steps(cfg)) >= seen_at_step + 3, 300, "three more steps", [producer, consumer])
    # the batch in progress when the change arrived may predate it; every later batch obeys it
    # the audit log first: every record it names was published before the topic is read, up to
    # its end offsets (it is never quiet while the producer runs: a read until quiet took 30 s)
    entries = audit_entries(Path(cfg.consumer.checkpoint_dir))
    staleness = step_staleness(entries, read_rollouts(cfg.kafka, to_end=True))
    after = [st for s, st in staleness.items() if s > seen_at_step + 1]
    assert after and all(st == 0 for st in after), after
    assert producer.metric("rlstream_producer_held_back_total", reason="staleness") > held0
    assert time.monotonic() - changed_at < 300


def admin(svc, body=None):
    code, raw = http_request(svc.url + "/admin/control", "POST" if body else "GET", body, token=ADMIN_TOKEN)
    assert code == 200, raw
    return json.loads(raw)


@pytest.mark.timeout(400)
def test_auto_moves_the_bound_until_an_operator_takes_it_back(pipeline):
    producer, consumer, cfg = pipeline
    wait_until(lambda: len(steps(cfg)) >= 1, 300, "a training step", [producer, consumer])
    start = int(consumer.metric("rlstream_control_setting", key="max_staleness"))
    assert admin(consumer, {"key": "max_staleness", "value": "auto"})["value"] == "auto"
    for svc in (producer, consumer):  # the controller's records reach every service
        wait_until(lambda: svc.metric("rlstream_control_setting", key="max_staleness") >= start + 2, 300,
                   f"{svc.command} applying the controller's bound", [producer, consumer])
    status = admin(consumer)["max_staleness_controller"]
    assert status["owns_bound"] and status["last_change"]["direction"] == "loosen"
    assert status["last_change"]["reason"].startswith("loosen ") and "healthy" in status["last_change"]["reason"]
    assert consumer.metric("rlstream_staleness_auto_changes_total", direction="loosen", signal="healthy",
                           published="true") >= 2
    # the real trainer's signals: an ESS in (0, 1], and its tokens spread over staleness buckets
    signals = {(dict(lab)["signal"], dict(lab)["staleness"]): v for (name, lab), v in parse(consumer.scrape()).items()
               if name == "rlstream_trainer_signal" and v == v}
    assert 0 < signals[("ess", "all")] <= 1 + 1e-9
    shares = [v for (sig, bucket), v in signals.items() if sig == "token_share"]
    assert shares and abs(sum(shares) - 1) < 1e-6
    # an operator's bound holds: the controller, which would loosen every step, stands by
    admin(consumer, {"key": "max_staleness", "value": 1})
    wait_until(lambda: consumer.metric("rlstream_control_setting", key="max_staleness_auto") == 0, 60,
               "the consumer applying the operator's bound", [producer, consumer])
    at = max(steps(cfg))
    wait_until(lambda: max(steps(cfg)) >= at + 3, 300, "three more steps", [producer, consumer])
    for svc in (producer, consumer):
        assert svc.metric("rlstream_control_setting", key="max_staleness") == 1
    assert admin(consumer)["max_staleness_controller"]["owns_bound"] is False
