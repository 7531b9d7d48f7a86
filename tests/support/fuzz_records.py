"""Bad rollout records for a live consumer, and the consumer's feed (the fuzz test and the
hostile bench).

    bad_record   hypothesis strategy: (kind, the DLQ field it must be refused for, bytes);
                 KINDS lists the kinds, DECODABLE those that decode up to the rule they break
    reuse        hypothesis strategy: None, or how a group id is reused (REUSES) and which slots
    pack         the template record's msgpack map with fields changed
    Live         publishes valid groups (optionally with a reused id) and bad records to a running
                 consumer, remembering where each refused record must land in the DLQ
    MARKER       the file a pickle bomb (PICKLE_BOMB) creates if anything unpickles it
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import msgpack
import numpy as np
from hypothesis import strategies as st

from rlstream.common.record import Rollout, encode
from rlstream.harness.supervisor import Service
from tests.support.audit import audit_steps
from tests.support.fakes import PickleBomb
from tests.support.synthetic import synthetic_group

G = 4
"""Samples per group of the live consumer's valid groups."""
MARKER = Path(f"/tmp/rlstream-pwned-{os.getpid()}")

PICKLE_BOMB = pickle.dumps(PickleBomb(MARKER))  # unpickled, it creates MARKER

# ---------------------------------------------------------------- bad records

TEMPLATE = synthetic_group("tmpl", G, 0, np.random.default_rng(0))[0]
_VALID_MAP = msgpack.unpackb(encode(TEMPLATE), raw=False)
_T = len(TEMPLATE.response_ids)


def pack(**changes) -> bytes:
    m = dict(_VALID_MAP)
    m.update(changes)
    return msgpack.packb(m, use_bin_type=True)


def _pack_repeating(key: str, second) -> bytes:
    """The template's map with `key` given a second time (msgpack alone would keep the last value)."""
    pairs = list(_VALID_MAP.items()) + [(key, second)]
    pk = msgpack.Packer(use_bin_type=True)
    return pk.pack_map_header(len(pairs)) + b"".join(pk.pack(k) + pk.pack(v) for k, v in pairs)


def _f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


@st.composite
def bad_record(draw, kinds: tuple[str, ...] | None = None) -> tuple[str, str, bytes]:
    """(kind, DLQ field it must be refused for, bytes); the kind drawn from `kinds` (default: all)."""
    kind = draw(st.sampled_from(kinds or KINDS))
    valid = encode(TEMPLATE)
    if kind == "truncated":
        return kind, "<bytes>", valid[:draw(st.integers(0, len(valid) - 1))]
    if kind == "schema":
        v = draw(st.integers(-(2**63), 2**64 - 1).filter(lambda x: x not in (1, 2)) | st.text(max_size=8) | st.none())
        return kind, "schema", pack(schema=v)
    if kind == "lengths":
        n = draw(st.integers(0, 3 * _T).filter(lambda x: x != _T))
        return kind, "logprobs", pack(logprobs=_f32(-np.ones(n)))
    if kind in ("nan_logprob", "positive_logprob"):
        lp = np.array(TEMPLATE.logprobs, dtype=np.float32)
        i = draw(st.integers(0, _T - 1))
        lp[i] = draw(st.sampled_from([np.nan, np.inf, -np.inf])) if kind == "nan_logprob" else\
            draw(st.floats(1e-3, 1e6, allow_nan=False))
        return kind, "logprobs", pack(logprobs=_f32(lp))
    if kind == "expert_id":
        re_ = np.array(TEMPLATE.routed_experts, dtype=np.uint8)
        flat = re_.reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.integers(TEMPLATE.num_experts, 255))
        return kind, "routed_experts", pack(routed_experts=re_.tobytes())
    if kind == "oversize":
        P = draw(st.integers(65_537, 70_000))  # RecordLimits.max_prompt_tokens = 65,536
        return kind, "prompt_ids", pack(prompt_ids=np.full(P, 5, dtype="<i4").tobytes())
    if kind == "repeated_key":
        key = draw(st.sampled_from(["reward", "policy_version", "logprobs"]))
        return kind, key, _pack_repeating(key, _VALID_MAP[key])
    if kind == "group_size":
        return kind, "group_size", pack(group_size=draw(st.sampled_from([G - 1, G + 1, 2 * G])))
    if kind == "future_version":
        return kind, "policy_version", pack(policy_version=draw(st.integers(1000, 10**9)))
    if kind == "long_sequence":  # the tiny model has 512 positions; routing rows follow P
        P = draw(st.integers(512, 700))
        rows = P + _T - 1
        routing = np.resize(np.asarray(TEMPLATE.routed_experts), (rows,) + TEMPLATE.routed_experts.shape[1:])
        return kind, "prompt_ids", pack(prompt_ids=np.full(P, 5, dtype="<i4").tobytes(),
                                         routed_experts=routing.tobytes(), routing_shape=list(routing.shape))
    return kind, "<bytes>", PICKLE_BOMB


REUSES = ["interleaved", "late", "same_slot"]
"""How a group id is reused (`Live.publish_valid_group`); every record of the second copy is refused."""


@st.composite
def reuse(draw) -> tuple[str, list[int]] | None:
    """None (most examples), or (how, the slots of the second copy)."""
    if draw(st.integers(0, 3)):
        return None
    return draw(st.sampled_from(REUSES)), draw(st.lists(st.integers(0, G - 1), min_size=1, max_size=G, unique=True))


DECODABLE = {"repeated_key", "group_size", "future_version", "long_sequence"}
"""Kinds whose record decodes up to the rule it breaks (its key must match its group_id)."""
KINDS = ["truncated", "schema", "lengths", "nan_logprob", "positive_logprob", "expert_id", "oversize", "pickle",
         "repeated_key", "group_size", "future_version", "long_sequence"]


# ---------------------------------------------------------------- the live consumer

class Live:
    def __init__(self, kafka, consumer: Service, ckpt: Path):
        from rlstream.common.kafka.publisher import RolloutPublisher

        self.kafka, self.consumer, self.ckpt = kafka, consumer, ckpt
        self.pub = RolloutPublisher(kafka)
        self.rng = np.random.default_rng(11)
        self.expected: dict[str, tuple[str, str]] = {}  # DLQ source -> (kind, field)
        self.valid_groups = 0
        self._seq = 0
        self.last_valid = ""  # the id of the last valid group published

    def version(self) -> int:
        return max(audit_steps(self.ckpt), default=0)

    def publish_valid_group(self, reused: tuple[str, list[int]] | None = None) -> None:
        """A valid group; with `reused` = (how, slots), also a second copy under a used id whose
        records must all be refused: interleaved with this group after its first record
        (another producer), under the id of an earlier valid group, or second records for
        slots this group holds (same producer) before its last sample."""
        self._seq += 1
        group = synthetic_group(f"ok-{self._seq}", G, self.version(), self.rng)
        if reused is None:
            self._publish_in_order([(r, False) for r in group])
        else:
            how, slots = reused
            gid = self.last_valid if how == "late" and self.last_valid else group[0].group_id
            second = synthetic_group(gid, G, self.version(), self.rng)
            if how != "same_slot":  # a third party's copy
                for r in second:
                    r.producer_id = "reuser"
            if how == "same_slot":  # slots this group holds when the copy comes: all but its last
                held = sorted({min(i, G - 2) for i in slots})
                self._publish_in_order([(r, False) for r in group[:-1]] + [(second[i], True) for i in held]
                                       + [(group[-1], False)])
            else:
                copy = [(second[i], True) for i in slots]
                self._publish_in_order([(group[0], False)] + copy + [(r, False) for r in group[1:]])
        self.valid_groups += 1
        self.last_valid = group[0].group_id

    def _publish_in_order(self, records: list[tuple[Rollout, bool]]) -> None:
        """One at a time, so the partition holds them in this order; (record, refused)."""
        for r, refused in records:
            d = self.pub.publish(r, timeout=60).result(timeout=60)
            if refused:
                self.expected[f"{d.topic}/{d.partition}/{d.offset}"] = ("reused", "group_id")

    def publish_bad(self, kind: str, field: str, value: bytes) -> None:
        self._seq += 1
        # keyed like the template's group: records that decode get past the key check to their own
        key = TEMPLATE.group_id.encode() if kind in DECODABLE else f"bad-{self._seq}".encode()
        d = self.pub.publish_bytes(key, value, timeout=60).result(timeout=60)
        self.expected[f"{d.topic}/{d.partition}/{d.offset}"] = (kind, field)
