"""The rollout record, schema v1: one Kafka message per sample.

Wire format: a msgpack map with string keys. Numeric arrays travel as raw
little-endian buffers (msgpack `bin`) and decode zero-copy with
`numpy.frombuffer`; nothing is ever a list of Python numbers.

| key              | type                        | meaning                                         |
|------------------|-----------------------------|-------------------------------------------------|
| schema           | int (= 1)                   | schema version                                  |
| rollout_id       | str, 1..256 chars           | unique id, for dedup                            |
| group_id         | str, 1..256 chars           | all G samples of one prompt share it (Kafka key)|
| sample_idx       | int in [0, group_size)      | index within the group                          |
| group_size       | int in [1, 2**20]           | G; a consumer refuses any G but its own         |
| producer_id      | str                         | who produced it                                 |
| created_at       | float                       | unix seconds                                    |
| prompt_ids       | bin int32[P], 1 <= P        | prompt token ids, in [0, vocab)                 |
| response_ids     | bin int32[T], 1 <= T        | sampled token ids, in [0, vocab)                |
| prompt_text      | str (optional)              |                                                 |
| logprobs         | bin float32[T]              | log mu_old of each sampled token (finite, <= 0) |
| temperature      | float > 0 (optional, 1.0)   | sampling temperature the log-probs were taken at|
| policy_version   | int >= 0                    | version at dispatch                             |
| token_versions   | bin int64[R,2] (optional)   | run-length (version, count); counts sum to T    |
| routed_experts   | bin uint8/uint16 (optional) | top-k expert ids, shape `routing_shape`         |
| routing_dtype    | "uint8" or "uint16"         | uint8 iff num_experts <= 256                    |
| routing_shape    | [rows, layers, top_k]       | rows = P+T-1 (scope "full") or T ("response")   |
| routing_scope    | "full" or "response"        |                                                 |
| num_experts      | int in [1, 65536]           | experts per MoE layer                           |
| reward           | float (finite)              |                                                 |
| reward_info      | map (optional)              | verifier details                                |
| finish_reason    | str                         | "stop", "length", "abort"                       |
| sampling_digest  | str                         | digest of the sampling parameters               |
| model_digest     | str                         | digest of the model files                       |

The routing keys (`routed_experts`, `routing_dtype`, `routing_shape`,
`routing_scope`, `num_experts`) travel together or not at all. Keys are
unique: a map (or nested map) that repeats a key is refused (msgpack would
otherwise keep the last value). Unknown keys are ignored, so optional keys can
be added without a new schema version (`temperature` was: absent means 1.0).
Generic limits are `RecordLimits` (P <= 65,536, T <= 131,072, layers <= 256,
top_k <= 64); a consumer adds its model's (vocabulary, layers, top_k, experts,
P + T <= positions) and its group size (consumer/intake.py).

A *claim-check pointer* replaces a record above the configured size: the map
`{schema: 1, rollout_id, group_id, claim_check: {uri, sha256, bytes}}`; the blob
at `uri` holds the full encoded record (see common/kafka/claimcheck.py).

Staleness of a sample = trainer version at the optimizer step - its oldest
token version (`Rollout.oldest_version`).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from common.errors import InvalidRecordError

SCHEMA_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort")
ROUTING_SCOPES = ("full", "response")
_DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2")}
_I32, _F32, _I64 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<i8")


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

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any response token was sampled with."""
        if self.token_versions is not None and len(self.token_versions):
            return int(self.token_versions[:, 0].min())
        return int(self.policy_version)

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
        "schema": SCHEMA_VERSION, "rollout_id": r.rollout_id, "group_id": r.group_id,
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
    return msgpack.packb(m, use_bin_type=True)


def encode_claim_pointer(p: ClaimPointer) -> bytes:
    return msgpack.packb({
        "schema": SCHEMA_VERSION, "rollout_id": p.rollout_id, "group_id": p.group_id,
        "claim_check": {"uri": p.uri, "sha256": p.sha256, "bytes": int(p.nbytes)},
    }, use_bin_type=True)


# --------------------------------------------------------------------- decode

_KEYS = frozenset(("schema", "rollout_id", "group_id", "sample_idx", "group_size", "producer_id", "created_at",
                   "prompt_ids", "response_ids", "prompt_text", "logprobs", "temperature", "policy_version",
                   "token_versions", "routed_experts", "routing_dtype", "routing_shape", "routing_scope",
                   "num_experts", "reward", "reward_info", "finish_reason", "sampling_digest", "model_digest",
                   "claim_check", "uri", "sha256", "bytes"))
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
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise InvalidRecordError("schema", f"unsupported schema version {schema!r} (this reader speaks {SCHEMA_VERSION})")
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
    )
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
    if not np.isfinite(r.logprobs).all():
        raise InvalidRecordError("logprobs", "must be finite (found NaN or inf)")
    if (r.logprobs > 0).any():
        raise InvalidRecordError("logprobs", "log-probabilities must be <= 0")
    if r.finish_reason not in FINISH_REASONS:
        raise InvalidRecordError("finish_reason", f"must be one of {FINISH_REASONS}, got {r.finish_reason!r}")
    if not math.isfinite(r.reward):
        raise InvalidRecordError("reward", "must be finite")
    if isinstance(r.temperature, bool) or not (math.isfinite(r.temperature) and r.temperature > 0):
        raise InvalidRecordError("temperature", f"must be a finite number > 0, got {r.temperature!r}")
    if r.policy_version < 0:
        raise InvalidRecordError("policy_version", "must be >= 0")
    _validate_token_versions(r, T)
    _validate_routing(r, P, T, limits)


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
