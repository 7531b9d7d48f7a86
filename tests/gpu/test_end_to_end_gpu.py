"""One end-to-end step on one GPU (issue #16): the producer and the trainer share
the device, each held to its share of its memory, and one policy version makes
the round trip.

    producer (upstream vLLM, a child process: `rlstream producer`)  <- VLLM_SHARE
        -> rollouts topic (the real tansu broker, tests/fixtures/kafka.py)
    trainer (Megatron-core, this process: consumer/service.py's ConsumerService,
             as tests/integration/test_consumer_service.py runs it)  <- TRAINER_SHARE
        -> one optimizer step -> weights v1 published and announced
    producer reloads v1 -> new records on the topic carry policy_version 1

Shares: vLLM's `kv_cache_memory_bytes` (and `gpu_memory_utilization`, which vLLM
checks against the free memory when it starts: the producer starts first) and
torch's `set_per_process_memory_fraction` for the trainer (its caching
allocator raises OOM past the fraction, so the step proves it fits). Routing
is off here (no R3): the routing paths have tests of their own.

Skipped without CUDA (tests/gpu/conftest.py), without vLLM or megatron-core
(`needs_vllm`, `needs_megatron`). Nothing touches CUDA at import.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from rlstream.common.config import RlstreamConfig
from tests.fixtures.kafka import make_kafka_settings

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

G, B = 4, 2
VLLM_SHARE = 0.35
"""Share of the device vLLM may take (gpu_memory_utilization)."""
TRAINER_SHARE = 0.45
"""Share of the device the trainer's allocator may take (set_per_process_memory_fraction)."""
KV_CACHE_BYTES = 1 << 30


def shared_config(kafka, model_dir: Path, tmp: Path) -> RlstreamConfig:
    """One config for both roles, as a deployment has (producer and consumer read the same file)."""
    return RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 0, "mode": "drop"},  # v0 records wait for v1 before more
        "producer": {"group_size": G, "max_tokens": 8, "max_groups_in_flight": 4,
                     "prompts": {"type": "jsonl", "path": str(tmp / "data" / "train.jsonl")},
                     "engine": {"dtype": "bfloat16", "max_model_len": 64, "routing": "off",
                                "kv_cache_memory_bytes": KV_CACHE_BYTES,
                                "gpu_memory_utilization": VLLM_SHARE}},
        "consumer": {"group_size": G, "groups_per_batch": B, "max_steps": 1, "dtype": "bfloat16",
                     "replay": "none", "optimizer": {"lr": 1e-4}, "group_timeout_s": 120.0,
                     "checkpoint_dir": str(tmp / "ckpt"), "weight_store_dir": str(tmp / "weights")}})


def records_until(kafka, pred, timeout_s: float, producer) -> list:
    """Every rollout on the topic, read until one satisfies `pred` (or the time is up)."""
    from rlstream.common.kafka.reader import RolloutReader

    seen, deadline = [], time.monotonic() + timeout_s
    with RolloutReader(kafka) as reader:
        while time.monotonic() < deadline and not any(pred(r) for r in seen):
            assert producer.alive, f"producer exited ({producer.returncode}):\n{producer.log_tail()}"
            seen.extend(item.rollout for item in reader.poll(max_records=1000, timeout_s=1.0))
    return seen


@pytest.mark.timeout(900)
def test_one_version_round_trip_with_producer_and_trainer_sharing_the_gpu(
        needs_vllm, needs_megatron, broker, tiny_model_dir, tmp_path):
    import torch

    from rlstream.harness.supervisor import Service, child_env
    from rlstream.toy.build import ensure_data
    from rlstream.consumer.service import ConsumerService

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    cfg = shared_config(kafka, tiny_model_dir, tmp_path)
    ensure_data(cfg, n_train=64, n_heldout=8)
    config = tmp_path / "rlstream.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    producer = Service("producer", config, tmp_path / "logs", sets=["producer.http.port=0"], env=child_env(2))
    with producer.start():
        producer.wait_ready(timeout_s=600.0)  # the engine holds its share before the trainer allocates
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(TRAINER_SHARE, 0)
        torch.cuda.reset_peak_memory_stats(0)

        svc = ConsumerService(cfg, broker.bootstrap)
        assert svc.run() == 0 and svc.version == 1  # one step: weights v1 published
        assert torch.cuda.max_memory_allocated(0) <= TRAINER_SHARE * total

        records = records_until(kafka, lambda r: r.policy_version >= 1, 300.0, producer)
        versions = {r.policy_version for r in records}
        assert 1 in versions, f"no record of v1 after the step (versions {sorted(versions)}):\n{producer.log_tail()}"
        assert versions <= {0, 1} and sum(r.policy_version == 0 for r in records) >= B * G
        assert producer.stop(timeout_s=120.0) == 0, producer.log_tail()
