"""The Parquet schema of an exported rollout: one row per record (docs/log.md has the table).

Arrays keep the record's types (int32 token ids, float32 log-probs); per-token
versions are expanded from the record's run-length pairs to one int64 per
response token; `loss_mask` is 1 on model tokens (all 1 for a single-turn,
schema-1 record); routing stays compact: the record's raw little-endian bytes
(`routed_experts`, uint8 or uint16 as `routing_dtype` says) with
`routing_shape` [rows, layers, top_k], so `np.frombuffer(b, dtype).reshape(shape)`
is the record's array. `reward_info` is JSON text. Kafka's own coordinates
(`partition`, `offset`, `kafka_timestamp`) and `claim_check` (the blob's
sha256 when the record came through one) say where each row came from.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from rlstream.common.record import Rollout

EXPORT_SCHEMA_VERSION = 1
"""In every file's key-value metadata (`rlstream.export_schema`); bumped when a column changes meaning."""

_LISTS = {"prompt_ids": np.int32, "response_ids": np.int32, "logprobs": np.float32, "loss_mask": np.uint8,
          "token_versions": np.int64}
"""The list columns and their element type."""

SCHEMA = pa.schema([
    ("partition", pa.int32()), ("offset", pa.int64()), ("kafka_timestamp", pa.timestamp("ms")),
    ("rollout_id", pa.string()), ("group_id", pa.string()), ("sample_idx", pa.int32()),
    ("group_size", pa.int32()), ("record_schema", pa.int8()), ("producer_id", pa.string()),
    ("created_at", pa.float64()), ("policy_version", pa.int64()),
    *[(k, pa.list_(pa.from_numpy_dtype(t))) for k, t in _LISTS.items()],
    ("reward", pa.float64()), ("reward_info", pa.string()), ("finish_reason", pa.string()),
    ("temperature", pa.float64()), ("prompt_text", pa.string()),
    ("sampling_digest", pa.string()), ("model_digest", pa.string()),
    ("routed_experts", pa.binary()), ("routing_dtype", pa.string()), ("routing_shape", pa.list_(pa.int32())),
    ("routing_scope", pa.string()), ("num_experts", pa.int32()), ("claim_check", pa.string()),
])

DICTIONARY_COLUMNS = ["group_id", "producer_id", "finish_reason", "sampling_digest", "model_digest",
                      "routing_dtype", "routing_scope"]
"""Columns worth a dictionary (few distinct values). Arrays and ids are written plain: a dictionary
attempt over token ids and routing bytes costs time and falls back anyway."""
STATISTICS_COLUMNS = ["partition", "offset", "kafka_timestamp", "sample_idx", "created_at", "policy_version",
                      "reward", "temperature", "num_experts"]
"""Columns with min/max statistics (what a reader filters on); none for the arrays."""


def token_versions(r: Rollout) -> np.ndarray:
    """int64[T]: the policy version of each response token."""
    if r.token_versions is None or not len(r.token_versions):
        return np.full(r.num_tokens, r.policy_version, dtype=np.int64)
    return np.repeat(r.token_versions[:, 0], r.token_versions[:, 1]).astype(np.int64, copy=False)


class RowBuffer:
    """The rows of one row group, column by column; `nbytes` is what they hold."""

    def __init__(self):
        self.cols: dict[str, list] = {f.name: [] for f in SCHEMA}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.cols["offset"])

    def add(self, r: Rollout, partition: int, offset: int, timestamp_ms: int, claim: str | None) -> None:
        c = self.cols
        routed = r.routed_experts
        scalars = {
            "partition": partition, "offset": offset, "kafka_timestamp": timestamp_ms,
            "rollout_id": r.rollout_id, "group_id": r.group_id, "sample_idx": r.sample_idx,
            "group_size": r.group_size, "record_schema": 1 if r.loss_mask is None else 2,
            "producer_id": r.producer_id, "created_at": float(r.created_at), "policy_version": r.policy_version,
            "reward": float(r.reward), "finish_reason": r.finish_reason, "temperature": float(r.temperature),
            "reward_info": None if r.reward_info is None else json.dumps(r.reward_info, sort_keys=True),
            "prompt_text": r.prompt_text, "sampling_digest": r.sampling_digest, "model_digest": r.model_digest,
            # bytes, not a memoryview of the array: pyarrow 26 never releases a memoryview it converts
            # (measured: +32 MB per 41 MB of rows, for good), so the export's memory grew with the topic
            "routed_experts": None if routed is None else np.ascontiguousarray(routed).tobytes(),
            "routing_dtype": None if routed is None else routed.dtype.name,
            "routing_shape": None if routed is None else list(routed.shape),
            "routing_scope": None if routed is None else r.routing_scope,
            "num_experts": r.num_experts, "claim_check": claim,
        }
        for k, v in scalars.items():
            c[k].append(v)
        arrays = {"prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "logprobs": r.logprobs,
                  "loss_mask": r.model_mask.astype(np.uint8), "token_versions": token_versions(r)}
        for k, a in arrays.items():
            c[k].append(a)
            self.nbytes += a.nbytes
        self.nbytes += 0 if routed is None else routed.nbytes

    def table(self) -> pa.Table:
        cols = {}
        for f in SCHEMA:
            if f.name in _LISTS:
                cols[f.name] = _list_array(self.cols[f.name], np.dtype(_LISTS[f.name]))
            else:
                cols[f.name] = pa.array(self.cols[f.name], type=f.type)
        return pa.Table.from_pydict(cols, schema=SCHEMA)


def _list_array(arrays: list[np.ndarray], dtype: np.dtype) -> pa.ListArray:
    """One list column from per-row numpy arrays, without a Python loop over elements."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
