"""The producer service with `producer.episodes` (calculator environment) as a real
process: vLLM CPU engine, real broker. It publishes every episode, in complete
groups, as valid records (schema 2 where a tool was called, else schema 1), counts
each episode's end in `rlstream_producer_episodes_total`, and exits 0 on SIGTERM."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import yaml

from rlstream.common.config import RlstreamConfig
from rlstream.harness.observe import metric_value as metric
from rlstream.harness.supervisor import Service, wait_until
from tests.fixtures.kafka import make_kafka_settings
from tests.support.topics import announce_trainer_start, read_valid_rollouts

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, B = 4, 2


@pytest.mark.timeout(600)
def test_producer_publishes_multi_turn_episodes_in_complete_groups(broker, tiny_model_dir, tmp_path):
    from rlstream.toy.build import ensure_data

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 1},
        "producer": {"group_size": G, "max_tokens": 6,
                     "prompts": {"type": "jsonl", "path": str(tmp_path / "data" / "train.jsonl")},
                     "http": {"port": 0}, "max_groups_in_flight": 4,
                     "episodes": {"env": "calculator", "max_turns": 3, "max_turn_tokens": 6,
                                  "max_episode_tokens": 40},
                     "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64}},
        "consumer": {"group_size": G, "groups_per_batch": B}})
    ensure_data(cfg, n_train=64, n_heldout=8)
    announce_trainer_start(kafka, groups_per_batch=B, group_size=G)
    path = tmp_path / "producer.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with Service("producer", path, tmp_path / "logs").start() as svc:
        cap = 2 * B * G  # (max_staleness + 1) batches before the absent trainer must advance
        wait_until(lambda: svc.try_metric("rlstream_producer_samples_total", 0.0) >= cap,
                   300, f"{cap} finished episodes", [svc], 0.5)
        text = svc.scrape()
        ends = {e: metric(text, "rlstream_producer_episodes_total", end=e) or 0
                for e in ("done", "max_turns", "max_tokens", "step_timeout", "env_error")}
        assert svc.stop(timeout_s=120) == 0, svc.log_tail(3000)
    records = read_valid_rollouts(kafka)
    assert len(records) >= cap and set(Counter(r.group_id for r in records).values()) == {G}
    assert sum(ends.values()) >= cap and ends["step_timeout"] == ends["env_error"] == 0
    for r in records:
        assert r.reward_info["end"] in ("done", "max_turns", "max_tokens") and r.reward in (0.0, 1.0)
        assert r.routed_experts.shape[0] == r.prompt_ids.size + r.num_tokens - 1
        if r.loss_mask is not None:  # the model called the tool: observations are environment tokens
            assert not r.loss_mask.all() and (r.logprobs[~r.loss_mask] == 0).all()
        assert np.all(r.logprobs[r.model_mask] <= 0)
