"""The producer service as a real process: vLLM CPU engine, real broker.

One producer subprocess per module (an engine start is the expensive part):
1. it publishes valid records with routing, then backpressure stops it at
   max_staleness (no trainer is advancing);
2. a weight announcement switches its version: new records carry it, and
   their log-probs are those of the new weights (not the old);
3. SIGTERM: it exits 0 and every acknowledged sample is on the topic, in
   complete groups.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest
import yaml

from rlstream.common.kafka.broker import free_port
from rlstream.common.config import RlstreamConfig
from tests.fixtures.kafka import make_kafka_settings
from rlstream.harness.observe import metric_value as metric

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, B, MAX_STALENESS = 4, 2, 1


def read_all(kafka, timeout_s=2.0):
    from rlstream.common.kafka.reader import RolloutReader

    with RolloutReader(kafka) as r:
        out, idle = [], 0
        while idle < 2:
            items = r.poll(max_records=1000, timeout_s=timeout_s / 2)
            idle = 0 if items else idle + 1
            out.extend(items)
    return [it.rollout for it in out]


def scrape(port) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def wait_for(pred, timeout, proc, what):
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if proc.poll() is not None:
            raise AssertionError(f"producer exited ({proc.returncode}) while waiting for {what}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def announce_trainer_start(kafka) -> None:
    """What a consumer says when it starts: version 0, nothing read yet, its batch
    shape (B, G). The producers' backpressure needs B; this test has no trainer."""
    from kafka import KafkaProducer

    from rlstream.common.control.messages import TrainerProgress
    from rlstream.common.kafka.client import client_kwargs

    msg = TrainerProgress(trainer_version=0, groups_per_batch=B, group_size=G)
    p = KafkaProducer(**client_kwargs(kafka), acks="all")
    p.send(kafka.topics.policy, key=msg.kind.encode(), value=msg.model_dump_json().encode()).get(timeout=10)
    p.close()


@pytest.fixture(scope="module")
def producer(broker, tiny_model_dir, tmp_path_factory):
    from rlstream.toy.build import ensure_data

    tmp = tmp_path_factory.mktemp("producer")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    port = free_port()
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "staleness": {"max_staleness": MAX_STALENESS},
        "producer": {"group_size": G, "max_tokens": 6,
                     "prompts": {"type": "jsonl", "path": str(tmp / "data" / "train.jsonl")},
                     "http": {"port": port}, "max_groups_in_flight": 8, "run_file": str(tmp / "producer.run.json"),
                     "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64}},
        # the store the test writes versions into as the trainer: producers take weights only from it
        "consumer": {"group_size": G, "groups_per_batch": B, "weight_store_dir": str(tmp / "weights")}})
    ensure_data(cfg, n_train=64, n_heldout=8)
    announce_trainer_start(kafka)
    path = tmp / "producer.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    log = tmp / "producer.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlstream", "producer", "-c", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    yield {"proc": proc, "kafka": kafka, "port": port, "log": log, "tmp": tmp, "cfg": cfg}
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.timeout(300)
def test_publishes_valid_records_then_backpressure_holds_at_max_staleness(producer):
    proc, kafka, port = producer["proc"], producer["kafka"], producer["port"]
    cap = (MAX_STALENESS + 1) * B * G  # records admitted before the (absent) trainer must advance
    wait_for(lambda: metric(scrape_or_empty(port), "rlstream_producer_held_back_total", reason="staleness") > 0,
             240, proc, "staleness backpressure")
    # backpressure engages as soon as the admitted groups are in flight, before
    # any is finished: wait for them (slow on a loaded machine), then give a
    # wrongly admitted group time to show up
    wait_for(lambda: metric(scrape_or_empty(port), "rlstream_producer_samples_total") >= cap,
             120, proc, f"{cap} finished samples")
    time.sleep(3)
    records = read_all(kafka)
    assert len(records) == cap, f"{len(records)} records, backpressure should cap at {cap}"
    text = scrape(port)
    assert metric(text, "rlstream_producer_samples_total") == cap
    for r in records:
        P, T = len(r.prompt_ids), len(r.response_ids)
        assert r.policy_version == 0 and r.group_size == G
        assert r.routed_experts is not None and r.routed_experts.shape == (P + T - 1, 2, 2)
        assert r.routed_experts.dtype == np.uint8 and int(r.routed_experts.max()) < 8
        assert np.all(r.logprobs <= 0) and np.isfinite(r.logprobs).all()
        assert r.reward in (0.0, 1.0)
    assert set(Counter(r.group_id for r in records).values()) == {G}


def scrape_or_empty(port) -> str:
    try:
        return scrape(port)
    except OSError:
        return ""


def hf_logprobs(model_dir, r) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.concatenate([r.prompt_ids, r.response_ids])[None].astype(np.int64))
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0, :-1].float(), -1)
    P = len(r.prompt_ids)
    return lp[P - 1:, :].gather(-1, ids[0, P:, None])[:, 0].numpy()


@pytest.mark.timeout(300)
def test_weight_announcement_switches_version_and_outputs(producer, tiny_model_dir):
    from kafka import KafkaProducer
    from safetensors.torch import load_file

    from rlstream.common.control.messages import TrainerProgress, WeightsReady
    from rlstream.common.kafka.client import client_kwargs
    from rlstream.common.kafka.reader import RolloutReader
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from rlstream.common.weights.store import WeightStore

    proc, kafka, tmp = producer["proc"], producer["kafka"], producer["tmp"]
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
        return [r for r in read_all(kafka) if r.policy_version == 1]
    fresh = wait_for(new_records, 120, proc, "records of version 1")
    assert metric(scrape(producer["port"]), "rlstream_producer_policy_version") == 1
    r = fresh[0]
    new_lp, old_lp = hf_logprobs(new_dir, r), hf_logprobs(tiny_model_dir, r)
    assert np.abs(new_lp - r.logprobs).max() < 1e-3, "records were not sampled from the new weights"
    assert np.abs(old_lp - r.logprobs).max() > 1e-2, "old and new weights give the same log-probs"


@pytest.mark.timeout(300)
def test_sigterm_exits_zero_and_loses_no_acknowledged_sample(producer):
    proc, kafka = producer["proc"], producer["kafka"]
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, producer["log"].read_text()[-3000:]
    log = producer["log"].read_text()
    line = [ln for ln in log.splitlines() if "producer drained: published=" in ln]
    assert line, log[-3000:]
    acked = int(line[-1].split("published=")[1].split()[0])
    records = read_all(kafka)
    assert len({r.rollout_id for r in records}) == acked == len(records)
    from rlstream.common.runfile import read_run_file
    status = read_run_file(producer["tmp"] / "producer.run.json")
    assert status["state"] == "stopped" and status["published"] == acked and status["pid"] == proc.pid
    assert status["http_url"] == f"http://127.0.0.1:{producer['port']}"
    assert set(Counter(r.group_id for r in records).values()) == {G}, "a partial group was published"
