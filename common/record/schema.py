"""The rollout record's types: `Rollout`, `ClaimPointer`, `RecordLimits` and the
schema's constants and value bounds (the wire format: the package docstring;
checks: validation.py; bytes: codec.py).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

SCHEMA_VERSION = 2
"""The newest schema this package reads and writes (it writes 1 when a record has no
environment tokens, so single-turn records stay readable by v1 readers)."""
SCHEMA_VERSIONS = (1, 2)
POINTER_SCHEMA = 1
FINISH_REASONS = ("stop", "length", "abort")
ROUTING_SCOPES = ("full", "response")
# The wire dtypes (little-endian), shared by validation.py and codec.py.
_DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2")}
_I32, _F32, _I64, _U8 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<i8"), np.dtype("<u1")
_BOOL = np.dtype(bool)

MIN_TEMPERATURE = 0.01
"""The lowest temperature vLLM samples at: it decodes greedily below 1e-5 (its
`_SAMPLING_EPS`; greedy log-probs are not those of softmax(logits / t)) and raises any
temperature in (0, 0.01) to 0.01 (its `_MAX_TEMP`), so a record below 0.01 claims
log-probs the engine never took. At 1e-30 the trainer's logits / t overflowed and a
step's KL metric read 2.6e29. tests/unit/common/test_record_limits.py pins both to vLLM's."""
MAX_TEMPERATURE = 100.0
"""Far above any useful sampling temperature (at 100 the softmax of a model's logits,
a few tens apart, is already near uniform); above it a record is garbage or hostile, and
1e300 made the trainer's logits / t underflow to an exactly uniform distribution."""
MAX_CLAIM_EPOCH = 2**31 - 1
"""Claims of one episode a journal can count (one per peer takeover: never near it)."""
MIN_LOGPROB = -1000.0
"""A sampled token had a non-zero probability in the sampler's float type: at least
2**-1074 even in float64 (log = -744.4), 2**-149 in float32 (log = -103.3). Anything
lower was not sampled; refusing it also keeps the trainer's sums of T log-probs (and
of log mu - log pi, the KL metric) far inside float32."""


@dataclass(frozen=True)
class RecordLimits:
    """Sizes a decoded record may not exceed (bad or hostile input guard)."""

    max_prompt_tokens: int = 65_536
    max_response_tokens: int = 131_072
    max_layers: int = 256
    max_top_k: int = 64
    max_experts: int = 65_536
    max_id_length: int = 256
    max_token_id: int = 2**31 - 1
    # What a consumer's model requires (None: accept any). A record whose routing
    # does not fit the model would crash the training forward, so it is invalid.
    model_layers: int | None = None
    model_top_k: int | None = None
    model_experts: int | None = None
    max_sequence_tokens: int | None = None
    """P + T at most this (the model's positions): a longer sequence costs the
    trainer far more than it is worth, or cannot be run at all."""
    group_size: int | None = None
    """The consumer's G: a record of another group size can never join a group."""
    max_abs_reward: float = 1e6
    """|reward| at most this. Rewards are scores (0/1 verifiers, small rubrics); the
    trainer takes group means and stds (squares: 1e12 here) and multiplies advantages
    by summed log-probs in float32 (max 3.4e38), so 1e6 leaves a wide margin, while a
    reward of 1e300 became inf (advantage NaN) the moment it was cast to float32."""

    @classmethod
    def for_model(cls, vocab_size: int, layers: int, top_k: int, experts: int,
                  positions: int | None = None) -> "RecordLimits":
        """Limits that also refuse token ids, routing and lengths the model cannot take."""
        return cls(max_token_id=vocab_size - 1, model_layers=layers, model_top_k=top_k, model_experts=experts,
                   max_sequence_tokens=positions)


DEFAULT_LIMITS = RecordLimits()


@dataclass
class Rollout:
    """One sample. Arrays are numpy; after `decode` they are read-only views."""

    rollout_id: str
    group_id: str
    sample_idx: int
    group_size: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    policy_version: int
    reward: float
    finish_reason: str = "stop"
    producer_id: str = ""
    created_at: float = field(default_factory=time.time)
    prompt_text: str | None = None
    token_versions: np.ndarray | None = None  # int64 [R, 2] (version, count)
    routed_experts: np.ndarray | None = None  # uint8/uint16 [rows, L, K]
    routing_scope: str = "full"
    num_experts: int = 0
    reward_info: dict | None = None
    sampling_digest: str = ""
    model_digest: str = ""
    temperature: float = 1.0
    """The sampling temperature: `logprobs` are log-probs of softmax(logits / temperature)."""
    loss_mask: np.ndarray | None = None
    """bool[T]: True on model tokens, False on environment tokens (schema 2);
    None: every response token is the model's (schema 1, single-turn)."""
    claim_epoch: int = 0
    """The journal claim epoch the episode was published under (0: first holder, or not journaled)."""

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def model_mask(self) -> np.ndarray:
        """bool[T], True on model tokens (all True for a single-turn record)."""
        if self.loss_mask is None:
            return np.ones(self.num_tokens, dtype=bool)
        return self.loss_mask

    @property
    def num_model_tokens(self) -> int:
        return self.num_tokens if self.loss_mask is None else int(self.loss_mask.sum())

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any model token was sampled with (environment
        tokens were not sampled: their version does not make a sample stale)."""
        tv = self.token_versions
        if tv is None or not len(tv):
            return int(self.policy_version)
        if self.loss_mask is None:
            return int(tv[:, 0].min())
        per_token = np.repeat(tv[:, 0], tv[:, 1])
        return int(per_token[self.loss_mask].min())

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex


@dataclass(frozen=True)
class ClaimPointer:
    """Stands on Kafka for a record whose bytes live in the blob store."""

    rollout_id: str
    group_id: str
    uri: str
    sha256: str
    nbytes: int


def routing_dtype_for(num_experts: int) -> np.dtype:
    """uint8 up to 256 experts (ids 0..255), else uint16."""
    return _DTYPES["uint8"] if num_experts <= 256 else _DTYPES["uint16"]
