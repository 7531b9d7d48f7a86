"""The rollout record's wire codec: `encode` / `decode` / `decode_any` and the
claim-check pointer (the wire format: the package docstring). Arrays travel as
little-endian `bin` buffers and decode as zero-copy read-only numpy views; a map that
repeats a key is refused; every decoded record is validated (validation.py).
"""
from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from rlstream.common.errors import InvalidRecordError
from rlstream.common.record.schema import (
    _BOOL,
    _DTYPES,
    _F32,
    _I32,
    _I64,
    _U8,
    DEFAULT_LIMITS,
    MAX_CLAIM_EPOCH,
    POINTER_SCHEMA,
    ROUTING_SCOPES,
    SCHEMA_VERSIONS,
    ClaimPointer,
    RecordLimits,
    Rollout,
    routing_dtype_for,
)
from rlstream.common.record.validation import validate


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
