"""What the engine is asked for and what it hands back: `SamplingConfig` in,
`FinishedSample` out.

A `FinishedSample` is the engine's view of one sample (request id, timings,
stop reason); the record is what travels on Kafka. The one conversion into
the record is the trajectory's (producer/rollout/trajectory.py:
`Trajectory.of_sample(s).to_rollout(...)` for a single-turn sample).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np



@dataclass(frozen=True)
class SamplingConfig:
    """Per-group sampling parameters (mapped onto vllm.SamplingParams)."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    """If set, sample i of a group uses seed + i (reproducible groups)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def digest(self) -> str:
        """The record's `sampling_digest`: what the trainer must reproduce."""
        return f"t={self.temperature},p={self.top_p},max={self.max_tokens}"


@dataclass
class FinishedSample:
    """One finished sample, as `RolloutEngine.step()` returns it."""

    tag: Any
    """The group tag passed to `submit_group` (the record's group id)."""
    sample_idx: int
    group_size: int
    request_id: str
    prompt_ids: np.ndarray  # int32[P]
    response_ids: np.ndarray  # int32[T]
    logprobs: np.ndarray  # float32[T], log mu_old of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    dispatch_version: int
    token_versions: list[tuple[int, int]]  # run-length [(version, count)], sums to T
    routed_experts: np.ndarray | None  # uint8/uint16 [P+T-1, L, K] (None if routing off)
    num_experts: int
    logprobs_mode: str
    submitted_at: float
    finished_at: float

    @property
    def weights_changed(self) -> bool:
        """True when a reload happened while this sample was generated."""
        return len(self.token_versions) > 1
