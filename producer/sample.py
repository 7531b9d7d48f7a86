"""What the engine is asked for and what it hands back: `SamplingConfig` in,
`FinishedSample` out, and the one conversion of a finished sample into the
rollout record (`FinishedSample.to_rollout`, schema in common/record.py).

A `FinishedSample` is the engine's view of one sample (request id, timings,
stop reason); the record is what travels on Kafka. The conversion fixes the
few places where the two differ:

- log-probs are clamped to <= 0 (float rounding can give +1e-8 for a token
  of probability ~1; the record refuses positive log-probs);
- a finish reason the record does not know is recorded as "stop";
- `token_versions` travels only when a reload happened mid-sample (one run
  is implied by `policy_version`);
- `num_experts` is 0 when the sample carries no routing;
- `reward_info` keeps only scalar values (str, int, float, bool);
- `temperature` is the sampling temperature: the log-probs are those of
  softmax(logits / temperature), and the trainer evaluates pi_old at the same
  temperature (docs/trainer.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.record import FINISH_REASONS, Rollout


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

    def to_rollout(self, reward: float, info: dict, producer_id: str, sampling: SamplingConfig,
                   prompt_text: str | None = None) -> Rollout:
        """The rollout record of this sample, scored `reward` (verifier details `info`).

        Staleness is then the record's `oldest_version` (there is no second copy here).
        """
        tv = np.asarray(self.token_versions, dtype=np.int64) if self.weights_changed else None
        return Rollout(
            rollout_id=Rollout.new_id(), group_id=self.tag, sample_idx=self.sample_idx,
            group_size=self.group_size, prompt_ids=self.prompt_ids, response_ids=self.response_ids,
            logprobs=np.minimum(self.logprobs, 0.0), policy_version=self.dispatch_version,
            reward=float(reward),
            finish_reason=self.finish_reason if self.finish_reason in FINISH_REASONS else "stop",
            producer_id=producer_id, prompt_text=prompt_text, token_versions=tv,
            routed_experts=self.routed_experts,
            num_experts=self.num_experts if self.routed_experts is not None else 0,
            reward_info={k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))},
            sampling_digest=sampling.digest, model_digest=f"v{self.dispatch_version}",
            temperature=float(sampling.temperature))
