"""The producer service as a real process: vLLM CPU engine, real broker.

One producer subprocess per module (an engine start is the expensive part):
1. it publishes valid records with routing, then backpressure stops it at
   max_staleness (no trainer is advancing);
2. a weight announcement switches its version: new records carry it, and
   their log-probs are those of the new weights (not the old);
3. SIGUSR1 writes every thread's stack to its log, and it goes on;
4. SIGTERM: it exits 0 and every acknowledged sample is on the topic, in
   complete groups.
"""
from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter

import numpy as np
import pytest
import yaml

from rlstream.common import process, stacks
from rlstream.common.config import RlstreamConfig
from rlstream.common.kafka.broker import free_port
from rlstream.harness.supervisor import Service, wait_until
from tests.fixtures.kafka import make_kafka_settings
from tests.support.hf_reference import hf_record_logprobs
from tests.support.topics import announce_trainer_start, read_valid_rollouts

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, B, MAX_STALENESS = 4, 2, 1


@pytest.fixture(scope="module")
def producer(broker, tiny_model_dir, tmp_path_factory):
    from rlstream.toy.build import ensure_data

    tmp = tmp_path_factory.mktemp("producer")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    port = free_port()  # a configured port: the run file must report it
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "staleness": {"max_staleness": MAX_STALENESS},
        "producer": {"group_size": G, "max_tokens": 6,
                     "prompts": {"type": "jsonl", "path": str(tmp / "data" / "train.jsonl")},
                     "http": {"port": port}, "max_groups_in_flight": 8,
                     "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64}},
        # the store the test writes versions into as the trainer: producers take weights only from it
        "consumer": {"group_size": G, "groups_per_batch": B, "weight_store_dir": str(tmp / "weights")}})
    ensure_data(cfg, n_train=64, n_heldout=8)
    announce_trainer_start(kafka, groups_per_batch=B, group_size=G)
    path = tmp / "producer.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with Service("producer", path, tmp / "logs").start() as svc:
        yield {"svc": svc, "kafka": kafka, "port": port, "tmp": tmp, "cfg": cfg}


@pytest.mark.timeout(300)
def test_publishes_valid_records_then_backpressure_holds_at_max_staleness(producer):
    svc, kafka = producer["svc"], producer["kafka"]
    cap = (MAX_STALENESS + 1) * B * G  # records admitted before the (absent) trainer must advance
    wait_until(lambda: svc.try_metric("rlstream_producer_held_back_total", 0.0, reason="staleness") > 0,
               240, "staleness backpressure", [svc], 0.5)
    # backpressure engages as soon as the admitted groups are in flight, before
    # any is finished: wait for them (slow on a loaded machine), then give a
    # wrongly admitted group time to show up
    wait_until(lambda: svc.try_metric("rlstream_producer_samples_total", 0.0) >= cap,
               120, f"{cap} finished samples", [svc], 0.5)
    time.sleep(3)
    records = read_valid_rollouts(kafka)
    assert len(records) == cap, f"{len(records)} records, backpressure should cap at {cap}"
    assert svc.metric("rlstream_producer_samples_total") == cap
    for r in records:
        P, T = len(r.prompt_ids), len(r.response_ids)
        assert r.policy_version == 0 and r.group_size == G
        assert r.routed_experts is not None and r.routed_experts.shape == (P + T - 1, 2, 2)
        assert r.routed_experts.dtype == np.uint8 and int(r.routed_experts.max()) < 8
        assert np.all(r.logprobs <= 0) and np.isfinite(r.logprobs).all()
        assert r.reward in (0.0, 1.0)
    assert set(Counter(r.group_id for r in records).values()) == {G}


@pytest.mark.timeout(300)
def test_weight_announcement_switches_version_and_outputs(producer, tiny_model_dir):
    from kafka import KafkaProducer
    from safetensors.torch import load_file

    from rlstream.common.control.messages import TrainerProgress, WeightsReady
    from rlstream.common.kafka.client import client_kwargs
    from rlstream.common.kafka.reader import RolloutReader
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from rlstream.common.weights.store import WeightStore

    svc, kafka, tmp = producer["svc"], producer["kafka"], producer["tmp"]
    new_dir = build_tiny_model(tmp / "seed1", TinyModelSpec(seed=1))
    m = WeightStore(tmp / "weights").write(1, load_file(str(new_dir / "model.safetensors")), new_dir)
    with RolloutReader(kafka) as r:
        ends = r.end_offsets()
    ready = WeightsReady(version=1, transport="file", uri=m["uri"], sha256=m["sha256"], bytes=m["bytes"])
    progress = TrainerProgress(trainer_version=1, read_offsets=ends,  # the trainer read everything
                               groups_per_batch=B, group_size=G)
    p = KafkaProducer(**client_kwargs(kafka), acks="all")
    for msg in (ready, progress):
        p.send(kafka.topics.policy, key=msg.kind.encode(), value=msg.model_dump_json().encode()).get(timeout=10)
    p.close()

    def new_records():
        return [r for r in read_valid_rollouts(kafka) if r.policy_version == 1]
    fresh = wait_until(new_records, 120, "records of version 1", [svc], 0.5)
    assert svc.metric("rlstream_producer_policy_version") == 1
    r = fresh[0]
    new_lp, old_lp = hf_record_logprobs(new_dir, r), hf_record_logprobs(tiny_model_dir, r)
    assert np.abs(new_lp - r.logprobs).max() < 1e-3, "records were not sampled from the new weights"
    assert np.abs(old_lp - r.logprobs).max() > 1e-2, "old and new weights give the same log-probs"


@pytest.mark.timeout(60)
def test_sigusr1_writes_every_threads_stack_and_the_producer_goes_on(producer):
    svc = producer["svc"]
    log_path = svc.log_path()
    start = log_path.stat().st_size
    samples = svc.metric("rlstream_producer_samples_total")
    os.kill(svc.pid, signal.SIGUSR1)  # the service's process only, not its engine's

    def dump():
        text = log_path.read_bytes()[start:].decode(errors="replace")
        return text if stacks.END in text else None
    text = wait_until(dump, 10, "the producer's stacks in its log", [svc], 0.05)
    text = text[text.index(stacks.BEGIN):text.index(stacks.END)]
    assert text.split("\n")[1].startswith("Thread MainThread "), text
    assert re.search(r'producer/service\.py", line \d+, in run$', text, re.M), text  # its loop
    assert "Thread stack-dumper " in text and text.count("\nThread ") >= 3, text  # every thread
    time.sleep(1.0)
    assert svc.alive, svc.log_tail()
    assert svc.metric("rlstream_producer_samples_total") >= samples  # its HTTP thread still answers


@pytest.mark.timeout(300)
def test_sigterm_exits_zero_and_loses_no_acknowledged_sample(producer):
    svc, kafka = producer["svc"], producer["kafka"]
    process.signal_group(svc.proc, signal.SIGTERM)  # the producer and its engine's processes
    assert svc.wait(timeout_s=120) == 0, svc.log_tail(3000)
    log = svc.log_text()
    line = [ln for ln in log.splitlines() if "producer drained: published=" in ln]
    assert line, log[-3000:]
    acked = int(line[-1].split("published=")[1].split()[0])
    records = read_valid_rollouts(kafka)
    assert len({r.rollout_id for r in records}) == acked == len(records)
    status = svc.status()
    assert status["state"] == "stopped" and status["published"] == acked and status["pid"] == svc.pid
    assert status["http_url"] == f"http://127.0.0.1:{producer['port']}"
    assert set(Counter(r.group_id for r in records).values()) == {G}, "a partial group was published"
