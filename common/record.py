"""The rollout record, schema v2 (v1 still read): one Kafka message per sample.

Wire format: a msgpack map with string keys. Numeric arrays travel as raw
little-endian buffers (msgpack `bin`) and decode zero-copy with
`numpy.frombuffer`; nothing is ever a list of Python numbers.

| key              | type                        | meaning                                         |
|------------------|-----------------------------|-------------------------------------------------|
| schema           | int (1 or 2)                | schema version (2: `loss_mask` present)         |
| rollout_id       | str, 1..256 chars           | unique id, for dedup                            |
| group_id         | str, 1..256 chars           | all G samples of one prompt share it (Kafka key)|
| sample_idx       | int in [0, group_size)      | index within the group                          |
| group_size       | int in [1, 2**20]           | G; a consumer refuses any G but its own         |
| producer_id      | str                         | who produced it                                 |
| created_at       | float                       | unix seconds                                    |
| prompt_ids       | bin int32[P], 1 <= P        | prompt token ids, in [0, vocab)                 |
| response_ids     | bin int32[T], 1 <= T        | sampled token ids, in [0, vocab)                |
| prompt_text      | str (optional)              |                                                 |
| logprobs         | bin float32[T]              | log mu_old of each sampled token, in [-1000, 0];|
|                  |                             | v2: exactly 0 on environment tokens             |
| loss_mask        | bin uint8[T] (v2, required) | 1 = model token, 0 = environment token; [0] = 1 |
| temperature      | float in [0.01, 100] (opt.) | sampling temperature the log-probs were taken at|
|                  |                             | (absent: 1.0)                                   |
| policy_version   | int >= 0                    | version at dispatch                             |
| token_versions   | bin int64[R,2] (optional)   | run-length (version, count); counts sum to T    |
|                  |                             | (environment tokens included, see below)        |
| routed_experts   | bin uint8/uint16 (optional) | top-k expert ids, shape `routing_shape`         |
| routing_dtype    | "uint8" or "uint16"         | uint8 iff num_experts <= 256                    |
| routing_shape    | [rows, layers, top_k]       | rows = P+T-1 (scope "full") or T ("response")   |
| routing_scope    | "full" or "response"        |                                                 |
| num_experts      | int in [1, 65536]           | experts per MoE layer                           |
| reward           | float in [-1e6, 1e6]        | (bounds: "Value limits" below)                  |
| reward_info      | map (optional)              | verifier details                                |
| finish_reason    | str                         | "stop", "length", "abort"                       |
| sampling_digest  | str                         | digest of the sampling parameters               |
| model_digest     | str                         | digest of the model files                       |
| claim_epoch      | int in [0, 2**31) (optional)| the journal claim epoch the episode was         |
|                  |                             | published under (absent: 0); see below          |

Schema 2 (multi-turn, docs/multi-turn.md): the response is the model's and the
environment's turns in order, `response_ids` = model turn 1, environment turn 1,
model turn 2, ... `loss_mask` says which token is which (uint8 0/1, length T);
the first response token is a model token (the prompt holds the first
observation), so a response cannot start with, or be all, environment tokens;
it may end with them. `logprobs` of environment tokens are exactly 0 (anything
else is refused: they were not sampled). An environment token's version in
`token_versions` is the producer's version when it was appended (it is never
sampled; staleness ignores it). Routing is per input position as in v1 (rows
P+T-1 or T), environment positions included. A record without environment
tokens is written as schema 1 (byte-identical to v1 writers); a v1 record
reads as an all-model mask (`loss_mask` None, `Rollout.model_mask` all True).
A v1 record that carries `loss_mask` is refused (its sender meant v2).

The routing keys (`routed_experts`, `routing_dtype`, `routing_shape`,
`routing_scope`, `num_experts`) travel together or not at all. Keys are
unique: a map (or nested map) that repeats a key is refused (msgpack would
otherwise keep the last value). Unknown keys are ignored, so optional keys can
be added without a new schema version (`temperature` was: absent means 1.0).
`claim_epoch` (fencing, docs/multi-turn.md "Durable episodes"): a journaled episode's
record carries the epoch of the journal claim its producer held it under (0 for its
first holder, one more each time a peer took it over). The consumer trains a rollout id
only from its newest epoch and sends an older epoch's copy to the DLQ (field
`claim_epoch`), so a producer cut off past its lease cannot get its copy trained beside
the peer's. Written only when above 0: other records are byte-identical to before.

Generic limits are `RecordLimits` (P <= 65,536, T <= 131,072, layers <= 256,
top_k <= 64); a consumer adds its model's (vocabulary, layers, top_k, experts,
P + T <= positions) and its group size (consumer/stream/intake.py).

A *claim-check pointer* replaces a record above the configured size: the map
`{schema: 1, rollout_id, group_id, claim_check: {uri, sha256, bytes}}` (schema 1 for
records of either version; a reader also takes 2); the blob
at `uri` holds the full encoded record (see common/kafka/claimcheck.py).

Value limits: the trainer divides the logits by `temperature`, exponentiates
log-prob differences and sums rewards, advantages and log-probs in float32, so a
value outside the range a sampler produces is refused like a malformed one
(InvalidRecordError naming the field: the dead-letter topic with the reason). The
bounds are `MIN_TEMPERATURE`, `MAX_TEMPERATURE`, `MIN_LOGPROB` and
`RecordLimits.max_abs_reward`; their reasons are beside them.

Staleness of a sample = trainer version at the optimizer step - its oldest
model token's version (`Rollout.oldest_version`).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from rlstream.common.errors import InvalidRecordError

SCHEMA_VERSION = 2
"""The newest schema this module reads and writes (it writes 1 when a record has no
environment tokens, so single-turn records stay readable by v1 readers)."""
SCHEMA_VERSIONS = (1, 2)
POINTER_SCHEMA = 1
FINISH_REASONS = ("stop", "length", "abort")
ROUTING_SCOPES = ("full", "response")
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


# --------------------------------------------------------------------- encode

def _bin(arr: np.ndarray, dtype: np.dtype) -> memoryview:
    """Little-endian raw bytes of `arr`, without a copy when already in shape."""
    return memoryview(np.ascontiguousarray(arr, dtype=dtype)).cast("B")


def encode(r: Rollout) -> bytes:
    """Rollout -> bytes. Validates first, so nothing invalid is ever published."""
    validate(r)
    m: dict[str, Any] = {
        "schema": 1 if r.loss_mask is None else 2, "rollout_id": r.rollout_id, "group_id": r.group_id,
        "sample_idx": int(r.sample_idx), "group_size": int(r.group_size),
        "producer_id": r.producer_id, "created_at": float(r.created_at),
        "prompt_ids": _bin(r.prompt_ids, _I32), "response_ids": _bin(r.response_ids, _I32),
        "logprobs": _bin(r.logprobs, _F32), "policy_version": int(r.policy_version),
        "reward": float(r.reward), "finish_reason": r.finish_reason,
        "sampling_digest": r.sampling_digest, "model_digest": r.model_digest,
        "temperature": float(r.temperature),
    }
    if r.prompt_text is not None:
        m["prompt_text"] = r.prompt_text
    if r.loss_mask is not None:
        m["loss_mask"] = _bin(r.loss_mask, _U8)
    if r.token_versions is not None:
        m["token_versions"] = _bin(r.token_versions, _I64)
    if r.routed_experts is not None:
        dt = routing_dtype_for(r.num_experts)
        m["routed_experts"] = _bin(r.routed_experts, dt)
        m["routing_dtype"] = "uint8" if dt.itemsize == 1 else "uint16"
        m["routing_shape"] = list(r.routed_experts.shape)
        m["routing_scope"] = r.routing_scope
        m["num_experts"] = int(r.num_experts)
    if r.reward_info is not None:
        m["reward_info"] = r.reward_info
    if r.claim_epoch:
        m["claim_epoch"] = int(r.claim_epoch)
    return msgpack.packb(m, use_bin_type=True)


def encode_claim_pointer(p: ClaimPointer) -> bytes:
    return msgpack.packb({
        "schema": POINTER_SCHEMA, "rollout_id": p.rollout_id, "group_id": p.group_id,
        "claim_check": {"uri": p.uri, "sha256": p.sha256, "bytes": int(p.nbytes)},
    }, use_bin_type=True)


# --------------------------------------------------------------------- decode

_KEYS = frozenset(("schema", "rollout_id", "group_id", "sample_idx", "group_size", "producer_id", "created_at",
                   "prompt_ids", "response_ids", "prompt_text", "logprobs", "temperature", "policy_version",
                   "token_versions", "routed_experts", "routing_dtype", "routing_shape", "routing_scope",
                   "num_experts", "reward", "reward_info", "finish_reason", "sampling_digest", "model_digest",
                   "claim_check", "uri", "sha256", "bytes", "loss_mask", "claim_epoch"))
"""Every key the schema names (a DLQ field label is one of these, never a sender's string)."""


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict:
    """msgpack's object_pairs_hook: a map, refused if it repeats a key (msgpack keeps the last)."""
    m = dict(pairs)
    if len(m) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise InvalidRecordError(dup if dup in _KEYS else "<bytes>", f"key {str(dup)[:64]!r} appears twice in a map")
    return m


def _unpack(buf: bytes) -> dict:
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise InvalidRecordError("<bytes>", f"expected bytes, got {type(buf).__name__}")
    try:
        # the hook costs ~2 us per record (tests/bench/wire.py: duplicate_key_check_seconds)
        m = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_bin_len=2**31 - 1,
                            object_pairs_hook=_unique_map)
    except InvalidRecordError:
        raise
    except Exception as e:  # msgpack raises many types on garbage
        raise InvalidRecordError("<bytes>", f"not a msgpack record ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict):
        raise InvalidRecordError("<bytes>", f"expected a map, got {type(m).__name__}")
    schema = m.get("schema")
    if schema not in SCHEMA_VERSIONS or not _is_int(schema):
        raise InvalidRecordError("schema", f"unsupported schema version {schema!r} (this reader speaks "
                                 f"{', '.join(map(str, SCHEMA_VERSIONS))})")
    return m


def decode_any(buf: bytes, limits: RecordLimits = DEFAULT_LIMITS) -> Rollout | ClaimPointer:
    """bytes -> Rollout, or ClaimPointer for a claim-check record.

    Raises InvalidRecordError (naming the field) for anything malformed; never
    any other exception.
    """
    m = _unpack(buf)
    if "claim_check" in m:
        return _decode_pointer(m, limits)
    return _from_map(m, limits)


def decode(buf: bytes, limits: RecordLimits = DEFAULT_LIMITS) -> Rollout:
    """bytes -> validated Rollout. A claim-check pointer is an error here."""
    out = decode_any(buf, limits)
    if isinstance(out, ClaimPointer):
        raise InvalidRecordError("claim_check", "is a claim-check pointer; resolve it through the blob store")
    return out


def _decode_pointer(m: dict, limits: RecordLimits) -> ClaimPointer:
    cc = m["claim_check"]
    if not isinstance(cc, dict):
        raise InvalidRecordError("claim_check", "must be a map")
    uri, sha, nbytes = cc.get("uri"), cc.get("sha256"), cc.get("bytes")
    if not isinstance(uri, str) or not uri:
        raise InvalidRecordError("claim_check.uri", "must be a non-empty string")
    if not isinstance(sha, str) or len(sha) != 64:
        raise InvalidRecordError("claim_check.sha256", "must be 64 hex characters")
    if not _is_int(nbytes) or nbytes <= 0:
        raise InvalidRecordError("claim_check.bytes", "must be a positive integer")
    return ClaimPointer(_str(m, "rollout_id", limits), _str(m, "group_id", limits), uri, sha, nbytes)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _req(m: dict, key: str) -> Any:
    if key not in m:
        raise InvalidRecordError(key, "missing")
    return m[key]


def _str(m: dict, key: str, limits: RecordLimits, optional: bool = False) -> str | None:
    if optional and key not in m:
        return None
    v = _req(m, key)
    if not isinstance(v, str):
        raise InvalidRecordError(key, f"must be a string, got {type(v).__name__}")
    if key in ("rollout_id", "group_id") and not (0 < len(v) <= limits.max_id_length):
        raise InvalidRecordError(key, f"length must be 1..{limits.max_id_length}")
    return v


def _int(m: dict, key: str, lo: int = 0, hi: int = 2**62) -> int:
    v = _req(m, key)
    if not _is_int(v) or not lo <= v <= hi:
        raise InvalidRecordError(key, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(m: dict, key: str) -> float:
    v = _req(m, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRecordError(key, f"must be a finite number, got {v!r}")
    return float(v)


def _array(m: dict, key: str, dtype: np.dtype, optional: bool = False) -> np.ndarray | None:
    if optional and key not in m:
        return None
    v = _req(m, key)
    if not isinstance(v, bytes):
        raise InvalidRecordError(key, f"must be a binary buffer, got {type(v).__name__}")
    if len(v) % dtype.itemsize:
        raise InvalidRecordError(key, f"{len(v)} bytes is not a multiple of {dtype.itemsize} ({dtype})")
    return np.frombuffer(v, dtype=dtype)  # zero-copy, read-only


def _from_map(m: dict, limits: RecordLimits) -> Rollout:
    r = Rollout(
        rollout_id=_str(m, "rollout_id", limits), group_id=_str(m, "group_id", limits),
        sample_idx=_int(m, "sample_idx"), group_size=_int(m, "group_size", 1, 1 << 20),
        producer_id=_str(m, "producer_id", limits), created_at=_float(m, "created_at"),
        prompt_ids=_array(m, "prompt_ids", _I32), response_ids=_array(m, "response_ids", _I32),
        logprobs=_array(m, "logprobs", _F32), policy_version=_int(m, "policy_version"),
        reward=_float(m, "reward"), finish_reason=_str(m, "finish_reason", limits),
        prompt_text=_str(m, "prompt_text", limits, optional=True),
        sampling_digest=_str(m, "sampling_digest", limits),
        model_digest=_str(m, "model_digest", limits),
        temperature=_float(m, "temperature") if "temperature" in m else 1.0,
        claim_epoch=_int(m, "claim_epoch", 0, MAX_CLAIM_EPOCH) if "claim_epoch" in m else 0,
    )
    r.loss_mask = _loss_mask_from_map(m)
    tv = _array(m, "token_versions", _I64, optional=True)
    if tv is not None:
        if tv.size % 2:
            raise InvalidRecordError("token_versions", "must hold (version, count) pairs")
        r.token_versions = tv.reshape(-1, 2)
    if "reward_info" in m:
        if not isinstance(m["reward_info"], dict):
            raise InvalidRecordError("reward_info", "must be a map")
        r.reward_info = m["reward_info"]
    if "routed_experts" in m:
        _routing_from_map(m, r, limits)
    validate(r, limits)
    return r


def _loss_mask_from_map(m: dict) -> np.ndarray | None:
    """v2: the uint8 0/1 mask as a read-only bool view; v1: None (and none allowed)."""
    if m["schema"] == 1:
        if "loss_mask" in m:
            raise InvalidRecordError("loss_mask", "is a schema 2 key; a record with environment tokens "
                                     "must say schema 2")
        return None
    raw = _array(m, "loss_mask", _U8)
    if raw.size and int(raw.max()) > 1:
        raise InvalidRecordError("loss_mask", "values must be 0 (environment) or 1 (model)")
    return raw.view(_BOOL)


def _routing_from_map(m: dict, r: Rollout, limits: RecordLimits) -> None:
    name = _str(m, "routing_dtype", limits)
    if name not in _DTYPES:
        raise InvalidRecordError("routing_dtype", f"must be uint8 or uint16, got {name!r}")
    shape = _req(m, "routing_shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(_is_int(s) and s >= 0 for s in shape)):
        raise InvalidRecordError("routing_shape", f"must be [rows, layers, top_k], got {shape!r}")
    r.num_experts = _int(m, "num_experts", 1, limits.max_experts)
    scope = _str(m, "routing_scope", limits)
    if scope not in ROUTING_SCOPES:
        raise InvalidRecordError("routing_scope", f"must be one of {ROUTING_SCOPES}, got {scope!r}")
    r.routing_scope = scope
    if _DTYPES[name] != routing_dtype_for(r.num_experts):
        raise InvalidRecordError("routing_dtype", f"{name} does not fit num_experts={r.num_experts}")
    flat = _array(m, "routed_experts", _DTYPES[name])
    if flat.size != shape[0] * shape[1] * shape[2]:
        raise InvalidRecordError("routed_experts", f"{flat.size} ids do not fill shape {shape}")
    r.routed_experts = flat.reshape(shape)


# ------------------------------------------------------------------- validate

def _check_dtype(name: str, arr: Any, want: np.dtype, ndim: int) -> None:
    if not isinstance(arr, np.ndarray):
        raise InvalidRecordError(name, f"must be a numpy array, got {type(arr).__name__}")
    if arr.dtype.newbyteorder("<") != want.newbyteorder("<") or arr.dtype.kind != want.kind:
        raise InvalidRecordError(name, f"dtype must be {want}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise InvalidRecordError(name, f"must have {ndim} dimension(s), got shape {arr.shape}")


def validate(r: Rollout, limits: RecordLimits = DEFAULT_LIMITS) -> None:
    """Strict checks; raises InvalidRecordError naming the first bad field."""
    if not 0 <= r.sample_idx < r.group_size:
        raise InvalidRecordError("sample_idx", f"{r.sample_idx} not in [0, group_size={r.group_size})")
    _check_dtype("prompt_ids", r.prompt_ids, _I32, 1)
    _check_dtype("response_ids", r.response_ids, _I32, 1)
    _check_dtype("logprobs", r.logprobs, _F32, 1)
    P, T = r.prompt_ids.shape[0], r.response_ids.shape[0]
    if not 1 <= P <= limits.max_prompt_tokens:
        raise InvalidRecordError("prompt_ids", f"length {P} not in [1, {limits.max_prompt_tokens}]")
    if not 1 <= T <= limits.max_response_tokens:
        raise InvalidRecordError("response_ids", f"length {T} not in [1, {limits.max_response_tokens}]")
    n = limits.max_sequence_tokens
    if n is not None and P + T > n:
        raise InvalidRecordError("prompt_ids" if P >= n else "response_ids",
                                 f"P + T = {P} + {T} exceeds the model's {n} positions")
    if limits.group_size is not None and r.group_size != limits.group_size:
        raise InvalidRecordError("group_size", f"{r.group_size} != consumer.group_size {limits.group_size}: "
                                 "producers and the consumer must use the same G")
    for name, ids in (("prompt_ids", r.prompt_ids), ("response_ids", r.response_ids)):
        if ids.min() < 0 or ids.max() > limits.max_token_id:
            raise InvalidRecordError(name, "token ids must be in [0, max_token_id]")
    if r.logprobs.shape[0] != T:
        raise InvalidRecordError("logprobs", f"length {r.logprobs.shape[0]} != response length {T}")
    _validate_logprobs(r.logprobs)
    if r.finish_reason not in FINISH_REASONS:
        raise InvalidRecordError("finish_reason", f"must be one of {FINISH_REASONS}, got {r.finish_reason!r}")
    _validate_scalars(r, limits)
    if r.policy_version < 0:
        raise InvalidRecordError("policy_version", "must be >= 0")
    if isinstance(r.claim_epoch, bool) or not isinstance(r.claim_epoch, int) or not 0 <= r.claim_epoch <= MAX_CLAIM_EPOCH:
        raise InvalidRecordError("claim_epoch", f"must be an integer in [0, {MAX_CLAIM_EPOCH}], got {r.claim_epoch!r}")
    _validate_loss_mask(r, T)
    _validate_token_versions(r, T)
    _validate_routing(r, P, T, limits)


def _validate_logprobs(lp: np.ndarray) -> None:
    if not np.isfinite(lp).all():
        raise InvalidRecordError("logprobs", "must be finite (found NaN or inf)")
    if lp.size and (float(lp.max()) > 0 or float(lp.min()) < MIN_LOGPROB):
        raise InvalidRecordError("logprobs", f"log-probabilities must be in [{MIN_LOGPROB:g}, 0] (a sampled "
                                 f"token's), found {float(lp.min()):g}..{float(lp.max()):g}")


def _validate_scalars(r: Rollout, limits: RecordLimits) -> None:
    """The reward and temperature: finite, and within what a sampler and a verifier produce."""
    if isinstance(r.reward, bool) or not math.isfinite(r.reward):
        raise InvalidRecordError("reward", f"must be a finite number, got {r.reward!r}")
    if abs(r.reward) > limits.max_abs_reward:
        raise InvalidRecordError("reward", f"{r.reward:g} is outside [-{limits.max_abs_reward:g}, "
                                 f"{limits.max_abs_reward:g}]")
    t = r.temperature
    if isinstance(t, bool) or not (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise InvalidRecordError("temperature", f"must be a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                                 f"(the range vLLM samples at), got {t!r}")


def _validate_loss_mask(r: Rollout, T: int) -> None:
    mask = r.loss_mask
    if mask is None:
        return
    _check_dtype("loss_mask", mask, _BOOL, 1)
    if mask.shape[0] != T:
        raise InvalidRecordError("loss_mask", f"length {mask.shape[0]} != response length {T}")
    if not mask[0]:
        raise InvalidRecordError("loss_mask", "the response must start with a model token (the prompt "
                                 "holds the first observation)")
    if (r.logprobs[~mask] != 0).any():
        raise InvalidRecordError("logprobs", "environment tokens (loss_mask 0) must carry log-prob 0: "
                                 "they were not sampled")


def _validate_token_versions(r: Rollout, T: int) -> None:
    tv = r.token_versions
    if tv is None:
        return
    _check_dtype("token_versions", tv, _I64, 2)
    if tv.shape[1] != 2 or tv.shape[0] == 0:
        raise InvalidRecordError("token_versions", f"must be [R, 2] with R >= 1, got {tv.shape}")
    if (tv[:, 0] < 0).any() or (tv[:, 1] <= 0).any():
        raise InvalidRecordError("token_versions", "versions must be >= 0 and counts > 0")
    if int(tv[:, 1].sum()) != T:
        raise InvalidRecordError("token_versions", f"counts sum to {int(tv[:, 1].sum())}, response has {T} tokens")
    if int(tv[0, 0]) != r.policy_version:
        raise InvalidRecordError("token_versions", "first run must carry the dispatch policy_version")


def _validate_routing(r: Rollout, P: int, T: int, limits: RecordLimits) -> None:
    re_ = r.routed_experts
    if re_ is None:
        return
    if not 1 <= r.num_experts <= limits.max_experts:
        raise InvalidRecordError("num_experts", f"must be in [1, {limits.max_experts}]")
    _check_dtype("routed_experts", re_, routing_dtype_for(r.num_experts), 3)
    rows, layers, k = re_.shape
    want = P + T - 1 if r.routing_scope == "full" else T
    if r.routing_scope not in ROUTING_SCOPES:
        raise InvalidRecordError("routing_scope", f"must be one of {ROUTING_SCOPES}")
    if rows != want:
        raise InvalidRecordError("routed_experts", f"{rows} rows, scope {r.routing_scope!r} needs {want} (P={P}, T={T})")
    if not 1 <= layers <= limits.max_layers or not 1 <= k <= min(limits.max_top_k, r.num_experts):
        raise InvalidRecordError("routed_experts", f"layers={layers}, top_k={k} out of range")
    if re_.size and int(re_.max()) >= r.num_experts:
        raise InvalidRecordError("routed_experts", f"expert id {int(re_.max())} >= num_experts {r.num_experts}")
    want = (limits.model_layers, limits.model_top_k, limits.model_experts)
    got = (layers, k, r.num_experts)
    for name, w, g in zip(("layers", "top_k", "num_experts"), want, got):
        if w is not None and w != g:
            raise InvalidRecordError("routed_experts", f"{name}={g} does not match the model's {w}")
