"""The producer service with `producer.episodes` (calculator environment) as a real
process: vLLM CPU engine, real broker. It publishes every episode, in complete
groups, as valid records (schema 2 where a tool was called, else schema 1), counts
each episode's end in `rlstream_producer_episodes_total`, and exits 0 on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import yaml

from rlstream.common.config import RlstreamConfig
from rlstream.harness.observe import metric_value as metric
from rlstream.common.kafka.broker import free_port
from tests.fixtures.kafka import make_kafka_settings
from tests.integration.test_producer_service import announce_trainer_start, read_all, scrape_or_empty, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, B = 4, 2


@pytest.mark.timeout(600)
def test_producer_publishes_multi_turn_episodes_in_complete_groups(broker, tiny_model_dir, tmp_path):
    from rlstream.toy.build import ensure_data

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    port = free_port()
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 1},
        "producer": {"group_size": G, "max_tokens": 6,
                     "prompts": {"type": "jsonl", "path": str(tmp_path / "data" / "train.jsonl")},
                     "http": {"port": port}, "max_groups_in_flight": 4,
                     "episodes": {"env": "calculator", "max_turns": 3, "max_turn_tokens": 6,
                                  "max_episode_tokens": 40},
                     "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64}},
        "consumer": {"group_size": G, "groups_per_batch": B}})
    ensure_data(cfg, n_train=64, n_heldout=8)
    announce_trainer_start(kafka)
    path = tmp_path / "producer.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlstream", "producer", "-c", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "producer.log", "w"),
                            start_new_session=True)
    try:
        cap = 2 * B * G  # (max_staleness + 1) batches before the absent trainer must advance
        wait_for(lambda: metric(scrape_or_empty(port), "rlstream_producer_samples_total") >= cap,
                 300, proc, f"{cap} finished episodes")
        text = scrape_or_empty(port)
        ends = {e: metric(text, "rlstream_producer_episodes_total", end=e) or 0
                for e in ("done", "max_turns", "max_tokens", "step_timeout", "env_error")}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    records = read_all(kafka)
    assert len(records) >= cap and set(Counter(r.group_id for r in records).values()) == {G}
    assert sum(ends.values()) >= cap and ends["step_timeout"] == ends["env_error"] == 0
    for r in records:
        assert r.reward_info["end"] in ("done", "max_turns", "max_tokens") and r.reward in (0.0, 1.0)
        assert r.routed_experts.shape[0] == r.prompt_ids.size + r.num_tokens - 1
        if r.loss_mask is not None:  # the model called the tool: observations are environment tokens
            assert not r.loss_mask.all() and (r.logprobs[~r.loss_mask] == 0).all()
        assert np.all(r.logprobs[r.model_mask] <= 0)
