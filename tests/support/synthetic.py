"""Synthetic rollout groups for consumer tests: valid records with known versions.

Records use the tiny model's vocabulary and MoE shape, plausible behaviour
log-probs, routing rows for every input token, binary rewards that differ
within a group (so advantages are non-zero).
"""
from __future__ import annotations

import uuid

import numpy as np

from rlstream.common.record import Rollout
from rlstream.toy.tinymodel import TinyModelSpec


def synthetic_group(group_id: str, G: int, version: int, rng: np.random.Generator,
                    spec: TinyModelSpec = TinyModelSpec(), prompt_len: int = 5, max_resp: int = 4,
                    routing: bool = True) -> list[Rollout]:
    prompt = rng.integers(3, 20, prompt_len).astype(np.int32)
    out = []
    for i in range(G):
        T = int(rng.integers(1, max_resp + 1))
        resp = rng.integers(3, 20, T).astype(np.int32)
        resp[-1] = 1  # <eos>
        routed = None
        if routing:
            rows = prompt_len + T - 1
            routed = np.stack([rng.permutation(spec.num_experts)[:spec.num_experts_per_tok]
                               for _ in range(rows * spec.num_hidden_layers)]).reshape(
                rows, spec.num_hidden_layers, spec.num_experts_per_tok).astype(np.uint8)
        out.append(Rollout(
            rollout_id=uuid.uuid4().hex, group_id=group_id, sample_idx=i, group_size=G,
            prompt_ids=prompt, response_ids=resp,
            logprobs=(-rng.uniform(0.5, 4.0, T)).astype(np.float32), policy_version=version,
            reward=float(i % 2), routed_experts=routed,
            num_experts=spec.num_experts if routing else 0, producer_id="synthetic"))
    return out


def publish_groups(publisher, groups: list[list[Rollout]]) -> list[str]:
    """Publish and wait for every acknowledgement; return the rollout ids."""
    futs, ids = [], []
    for g in groups:
        for r in g:
            futs.append(publisher.publish(r, timeout=30))
            ids.append(r.rollout_id)
    for f in futs:
        f.result(timeout=60)
    return ids
