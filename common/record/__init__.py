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
`RecordLimits.max_abs_reward`; their reasons are beside them (schema.py).

Staleness of a sample = trainer version at the optimizer step - its oldest
model token's version (`Rollout.oldest_version`).

Layout: schema.py (the types, constants and value bounds), validation.py
(`validate`), codec.py (`encode`, `decode`, `decode_any`, `encode_claim_pointer`: the
wire format above). Their public names are importable from this package.
"""
from __future__ import annotations

from rlstream.common.record.codec import decode, decode_any, encode, encode_claim_pointer
from rlstream.common.record.schema import (
    DEFAULT_LIMITS,
    FINISH_REASONS,
    MAX_CLAIM_EPOCH,
    MAX_TEMPERATURE,
    MIN_LOGPROB,
    MIN_TEMPERATURE,
    POINTER_SCHEMA,
    ROUTING_SCOPES,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    ClaimPointer,
    RecordLimits,
    Rollout,
    routing_dtype_for,
)
from rlstream.common.record.validation import validate

__all__ = [
    "DEFAULT_LIMITS", "FINISH_REASONS", "MAX_CLAIM_EPOCH", "MAX_TEMPERATURE", "MIN_LOGPROB", "MIN_TEMPERATURE",
    "POINTER_SCHEMA", "ROUTING_SCOPES", "SCHEMA_VERSION", "SCHEMA_VERSIONS", "ClaimPointer", "RecordLimits",
    "Rollout", "decode", "decode_any", "encode", "encode_claim_pointer", "routing_dtype_for", "validate",
]
