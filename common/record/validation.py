"""`validate`: the rollout record's strict checks, run by `encode` before a record is
published and by `decode` after it is read; an InvalidRecordError names the first bad
field (the bounds and their reasons: schema.py).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlstream.common.errors import InvalidRecordError
from rlstream.common.record.schema import (
    _BOOL,
    _F32,
    _I32,
    _I64,
    DEFAULT_LIMITS,
    FINISH_REASONS,
    MAX_CLAIM_EPOCH,
    MAX_TEMPERATURE,
    MIN_LOGPROB,
    MIN_TEMPERATURE,
    ROUTING_SCOPES,
    RecordLimits,
    Rollout,
    routing_dtype_for,
)


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
