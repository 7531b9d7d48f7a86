"""Session fixtures for the kafka area (see tests/conftest.py).

- `broker`: ONE real tansu broker per test session (EmbeddedBroker on a free
  loopback port, Kafka over TCP). Tests that pause or kill a broker start
  their own instead (`fresh_broker`), so the session broker stays healthy.
- `kafka_settings`: KafkaSettings pointing at the session broker with topic
  names unique to the test (so tests never see each other's records), its
  topics created, and a per-test blob directory. `make_kafka_settings` is the
  same as a plain function, for tests that need several or other overrides.
- `realistic_rollout(...)`: a rollout of production shape (defaults: 4,096
  response tokens, 48 layers, top-8 of 128 experts, full-sequence routing).
"""
from __future__ import annotations

import itertools
import os
import uuid

import numpy as np
import pytest

from common.kafka.broker import EmbeddedBroker
from common.config import BrokerSettings, KafkaSettings, TopicSettings
from common.kafka.client import ensure_topics
from common.record import Rollout, routing_dtype_for

_COUNTER = itertools.count()


def make_kafka_settings(bootstrap: str, blob_dir, create: bool = True, **overrides) -> KafkaSettings:
    """KafkaSettings with unique topic names (prefix `t<uid>.`) on `bootstrap`."""
    uid = f"t{os.getpid()}-{next(_COUNTER)}-{uuid.uuid4().hex[:6]}"
    partitions = overrides.pop("rollouts_partitions", 4)
    topics = TopicSettings(rollouts=f"{uid}.rollouts", policy=f"{uid}.policy", control=f"{uid}.control",
                           dlq=f"{uid}.dlq", stale=f"{uid}.stale", rollouts_partitions=partitions)
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topics=topics, blob_dir=str(blob_dir), **overrides)
    if create:
        ensure_topics(kafka)
    return kafka


@pytest.fixture(scope="session")
def broker():
    """The session's real tansu broker (memory storage, free loopback port)."""
    b = EmbeddedBroker(BrokerSettings(port=0)).start()
    yield b
    b.stop()


@pytest.fixture
def fresh_broker():
    """A broker of this test alone (for outage tests that pause or stop it)."""
    b = EmbeddedBroker(BrokerSettings(port=0)).start()
    yield b
    b.stop()


@pytest.fixture
def kafka_settings(broker, tmp_path):
    """KafkaSettings on the session broker; topics unique to this test, created."""
    return make_kafka_settings(broker.bootstrap, tmp_path / "blobs")


def realistic_rollout(response_tokens: int = 4096, prompt_tokens: int = 256, layers: int = 48, top_k: int = 8,
                      num_experts: int = 128, group_id: str | None = None, sample_idx: int = 0,
                      group_size: int = 8, seed: int = 0, scope: str = "full", policy_version: int = 3,
                      vocab: int = 151_936) -> Rollout:
    """A valid rollout of production shape, deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    P, T = prompt_tokens, response_tokens
    rows = P + T - 1 if scope == "full" else T
    # top-k distinct experts per (row, layer): a random offset plus k distinct ids, mod E
    routed = (rng.integers(0, num_experts, (rows, layers, 1)) + rng.permutation(num_experts)[:top_k]) % num_experts
    routed = routed.astype(routing_dtype_for(num_experts))
    split = T // 2
    return Rollout(
        rollout_id=uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | sample_idx).hex,
        group_id=group_id or f"g-{seed}", sample_idx=sample_idx, group_size=group_size,
        prompt_ids=rng.integers(0, vocab, P, dtype=np.int32),
        response_ids=rng.integers(0, vocab, T, dtype=np.int32),
        logprobs=-rng.exponential(1.0, T).astype(np.float32),
        policy_version=policy_version, reward=float(rng.random()), finish_reason="length",
        producer_id="test-producer", prompt_text="What is 2+2?",
        token_versions=np.array([[policy_version, split], [policy_version + 1, T - split]], dtype=np.int64),
        routed_experts=routed, routing_scope=scope, num_experts=num_experts,
        reward_info={"verifier": "exact_match", "correct": True},
        sampling_digest="sd-0", model_digest="md-0",
    )
