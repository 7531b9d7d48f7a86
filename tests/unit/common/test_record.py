"""Schema v1 rollout record: round trips, validation naming fields, routing dtypes, zero-copy decode."""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from rlstream.common.errors import InvalidRecordError
from rlstream.common.record import (
    ClaimPointer,
    Rollout,
    decode,
    decode_any,
    encode,
    encode_claim_pointer,
    RecordLimits,
)
from tests.fixtures.kafka import realistic_rollout

ARRAYS = ("prompt_ids", "response_ids", "logprobs", "token_versions", "routed_experts")
SCALARS = ("rollout_id", "group_id", "sample_idx", "group_size", "producer_id", "created_at", "prompt_text",
           "policy_version", "reward", "finish_reason", "routing_scope", "num_experts", "reward_info",
           "sampling_digest", "model_digest", "temperature")


def small(**kw) -> Rollout:
    args = dict(response_tokens=12, prompt_tokens=5, layers=3, top_k=2, num_experts=8)
    args.update(kw)
    return realistic_rollout(**args)


def assert_same(a: Rollout, b: Rollout) -> None:
    for name in SCALARS:
        assert getattr(a, name) == getattr(b, name), name
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and np.array_equal(x, y), name


# ----------------------------------------------------------------- round trips

@pytest.mark.timeout(60)
def test_round_trip_realistic_shape():
    r = realistic_rollout()  # 4,096 response tokens, 48 layers, top-8 of 128 experts
    buf = encode(r)
    out = decode(buf)
    assert_same(r, out)
    P, T = 256, 4096
    assert out.routed_experts.shape == (P + T - 1, 48, 8) and out.routed_experts.dtype == np.uint8
    # the routing dominates: 384 B per token, plus ids and logprobs, plus a small header
    assert len(buf) < (P + T - 1) * 384 + (P + T) * 4 + T * 4 + 1024
    assert out.oldest_version == 3


@pytest.mark.timeout(30)
def test_round_trip_minimal_and_response_scope():
    r = Rollout(rollout_id="r", group_id="g", sample_idx=0, group_size=1,
                prompt_ids=np.array([1], np.int32), response_ids=np.array([2], np.int32),
                logprobs=np.array([0.0], np.float32), policy_version=0, reward=0.0)
    out = decode(encode(r))
    assert out.routed_experts is None and out.token_versions is None and out.prompt_text is None
    assert out.oldest_version == 0
    r2 = small(scope="response")
    out2 = decode(encode(r2))
    assert out2.routing_scope == "response" and out2.routed_experts.shape == (12, 3, 2)


@pytest.mark.timeout(30)
def test_zero_copy_read_only_views():
    out = decode(encode(small()))
    for name in ARRAYS:
        arr = getattr(out, name)
        assert not arr.flags.writeable, name
        base = arr
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        assert isinstance(base, bytes), f"{name} is not a view on the message bytes"
    assert out.prompt_ids.dtype == np.dtype("<i4") and out.logprobs.dtype == np.dtype("<f4")


@pytest.mark.timeout(30)
def test_routing_uint8_up_to_256_experts_else_uint16():
    r8 = small(num_experts=256, top_k=4)
    r8.routed_experts[0, 0, 0] = 255
    m = msgpack.unpackb(encode(r8))
    assert m["routing_dtype"] == "uint8" and len(m["routed_experts"]) == r8.routed_experts.size
    assert decode(encode(r8)).routed_experts[0, 0, 0] == 255

    r16 = small(num_experts=257, top_k=4)
    r16.routed_experts[0, 0, 0] = 256
    m = msgpack.unpackb(encode(r16))
    assert m["routing_dtype"] == "uint16" and len(m["routed_experts"]) == 2 * r16.routed_experts.size
    out = decode(encode(r16))
    assert out.routed_experts.dtype == np.uint16 and out.routed_experts[0, 0, 0] == 256

    # a uint8 array for >256 experts is refused at encode (it cannot hold the ids)
    bad = small(num_experts=300, top_k=4)
    bad.routed_experts = bad.routed_experts.astype(np.uint8)
    with pytest.raises(InvalidRecordError) as e:
        encode(bad)
    assert e.value.field == "routed_experts"
    # and on the wire, a dtype that does not fit num_experts is refused at decode
    m = msgpack.unpackb(encode(small(num_experts=8)))
    m["routing_dtype"], m["routed_experts"] = "uint16", np.zeros(15 * 3 * 2, np.uint16).tobytes()
    with pytest.raises(InvalidRecordError) as e:
        decode(msgpack.packb(m))
    assert e.value.field == "routing_dtype"


@pytest.mark.timeout(30)
def test_claim_pointer_round_trip():
    p = ClaimPointer("rid", "gid", "file:///x/ab/" + "a" * 64, "a" * 64, 123)
    assert decode_any(encode_claim_pointer(p)) == p
    with pytest.raises(InvalidRecordError) as e:
        decode(encode_claim_pointer(p))
    assert e.value.field == "claim_check"


# ------------------------------------------------- every rule names its field

def _set(**changes):
    def f(r):
        for k, v in changes.items():
            setattr(r, k, v)
    return f


def _arr(name, fn):
    def f(r):
        a = np.array(getattr(r, name))
        setattr(r, name, fn(a))
    return f


def _poke(name, idx, value):
    def f(r):
        a = np.array(getattr(r, name))
        a[idx] = value
        setattr(r, name, a)
    return f


ENCODE_RULES = [
    ("sample_idx out of group", _set(sample_idx=8), "sample_idx"),
    ("negative sample_idx", _set(sample_idx=-1), "sample_idx"),
    ("prompt dtype", _arr("prompt_ids", lambda a: a.astype(np.int64)), "prompt_ids"),
    ("prompt ndim", _arr("prompt_ids", lambda a: a.reshape(1, -1)), "prompt_ids"),
    ("empty prompt", _arr("prompt_ids", lambda a: a[:0]), "prompt_ids"),
    ("negative token id", _poke("prompt_ids", 0, -1), "prompt_ids"),
    ("response dtype", _arr("response_ids", lambda a: a.astype(np.float32)), "response_ids"),
    ("response too long", _arr("response_ids", lambda a: np.zeros(131_073, np.int32)), "response_ids"),
    ("logprobs dtype", _arr("logprobs", lambda a: a.astype(np.float64)), "logprobs"),
    ("logprobs length", _arr("logprobs", lambda a: a[:-1]), "logprobs"),
    ("logprob NaN", _poke("logprobs", 0, np.nan), "logprobs"),
    ("logprob inf", _poke("logprobs", 0, -np.inf), "logprobs"),
    ("positive logprob", _poke("logprobs", 0, 0.5), "logprobs"),
    ("logprob below any sampler's", _poke("logprobs", 0, -1e4), "logprobs"),
    ("logprob near float32 min", _poke("logprobs", 0, -3e38), "logprobs"),
    ("finish_reason", _set(finish_reason="timeout"), "finish_reason"),
    ("reward NaN", _set(reward=float("nan")), "reward"),
    ("reward 1e300", _set(reward=1e300), "reward"),
    ("reward -1e7", _set(reward=-1e7), "reward"),
    ("negative policy_version", _set(policy_version=-1), "policy_version"),
    ("token_versions shape", _arr("token_versions", lambda a: a.reshape(-1)), "token_versions"),
    ("token_versions dtype", _arr("token_versions", lambda a: a.astype(np.int32)), "token_versions"),
    ("token_versions count sum", _poke("token_versions", (1, 1), 1), "token_versions"),
    ("token_versions zero count", _poke("token_versions", (0, 1), 0), "token_versions"),
    ("token_versions first run", _poke("token_versions", (0, 0), 2), "token_versions"),
    ("num_experts 0", _set(num_experts=0), "num_experts"),
    ("temperature 0", _set(temperature=0.0), "temperature"),
    ("temperature negative", _set(temperature=-0.7), "temperature"),
    ("temperature NaN", _set(temperature=float("nan")), "temperature"),
    ("temperature 1e-30", _set(temperature=1e-30), "temperature"),
    ("temperature below vLLM's floor", _set(temperature=0.005), "temperature"),
    ("temperature 1e300", _set(temperature=1e300), "temperature"),
    ("temperature 101", _set(temperature=101.0), "temperature"),
    ("routing rows", _arr("routed_experts", lambda a: a[:-1]), "routed_experts"),
    ("routing scope rows", _set(routing_scope="response"), "routed_experts"),
    ("expert id too large", _poke("routed_experts", (0, 0, 0), 8), "routed_experts"),
    ("routing ndim", _arr("routed_experts", lambda a: a.reshape(a.shape[0], -1)), "routed_experts"),
    ("top_k > experts", _set(num_experts=1), "routed_experts"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what,mutate,field", ENCODE_RULES, ids=[r[0] for r in ENCODE_RULES])
def test_encode_refuses_invalid_naming_the_field(what, mutate, field):
    r = small()
    encode(r)  # valid before the mutation
    mutate(r)
    with pytest.raises(InvalidRecordError) as e:
        encode(r)
    assert e.value.field == field, str(e.value)
    assert e.value.reason and field in str(e.value)


def _wire(**changes):
    m = msgpack.unpackb(encode(small()))
    for k, v in changes.items():
        if v is KeyError:
            m.pop(k)
        else:
            m[k] = v
    return msgpack.packb(m, use_bin_type=True)


WIRE_RULES = [
    ("not msgpack", b"\xc1", "<bytes>"),
    ("not a map", msgpack.packb([1, 2]), "<bytes>"),
    ("schema 3", _wire(schema=3), "schema"),
    ("schema 2 without loss_mask", _wire(schema=2), "loss_mask"),
    ("schema true", _wire(schema=True), "schema"),
    ("missing schema", _wire(schema=KeyError), "schema"),
    ("missing rollout_id", _wire(rollout_id=KeyError), "rollout_id"),
    ("empty rollout_id", _wire(rollout_id=""), "rollout_id"),
    ("long group_id", _wire(group_id="g" * 300), "group_id"),
    ("group_size 0", _wire(group_size=0), "group_size"),
    ("sample_idx str", _wire(sample_idx="0"), "sample_idx"),
    ("sample_idx bool", _wire(sample_idx=True), "sample_idx"),
    ("created_at str", _wire(created_at="now"), "created_at"),
    ("prompt_ids list", _wire(prompt_ids=[1, 2, 3]), "prompt_ids"),
    ("prompt_ids odd bytes", _wire(prompt_ids=b"\x00" * 7), "prompt_ids"),
    ("logprobs missing", _wire(logprobs=KeyError), "logprobs"),
    ("reward inf", _wire(reward=float("inf")), "reward"),
    ("reward str", _wire(reward="1"), "reward"),
    ("policy_version float", _wire(policy_version=1.5), "policy_version"),
    ("token_versions odd", _wire(token_versions=b"\x00" * 24), "token_versions"),
    ("reward_info list", _wire(reward_info=[1]), "reward_info"),
    ("routing_dtype int8", _wire(routing_dtype="int8"), "routing_dtype"),
    ("routing_shape 2d", _wire(routing_shape=[16, 6]), "routing_shape"),
    ("routing_shape negative", _wire(routing_shape=[-16, 3, 2]), "routing_shape"),
    ("routing_shape mismatch", _wire(routing_shape=[16, 3, 3]), "routed_experts"),
    ("routing_scope", _wire(routing_scope="all"), "routing_scope"),
    ("num_experts missing", _wire(num_experts=KeyError), "num_experts"),
    ("finish_reason int", _wire(finish_reason=1), "finish_reason"),
    ("temperature 0", _wire(temperature=0.0), "temperature"),
    ("temperature str", _wire(temperature="0.7"), "temperature"),
    ("temperature bool", _wire(temperature=True), "temperature"),
    ("temperature 1e-30", _wire(temperature=1e-30), "temperature"),
    ("temperature 1e300", _wire(temperature=1e300), "temperature"),
    ("reward 1e300", _wire(reward=1e300), "reward"),
    ("logprobs -1e30", _wire(logprobs=np.full(12, -1e30, "<f4").tobytes()), "logprobs"),
    ("claim_check not a map", _wire(claim_check=5), "claim_check"),
    ("claim_check bad sha", _wire(claim_check={"uri": "file:///x", "sha256": "ab", "bytes": 3}),
     "claim_check.sha256"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what,buf,field", WIRE_RULES, ids=[r[0] for r in WIRE_RULES])
def test_decode_refuses_invalid_naming_the_field(what, buf, field):
    with pytest.raises(InvalidRecordError) as e:
        decode(buf)
    assert e.value.field == field, str(e.value)


@pytest.mark.timeout(30)
def test_limits_apply_at_decode():
    buf = encode(small(response_tokens=40))
    with pytest.raises(InvalidRecordError) as e:
        decode(buf, RecordLimits(max_response_tokens=39))
    assert e.value.field == "response_ids"
    with pytest.raises(InvalidRecordError) as e:
        decode(buf, RecordLimits(max_layers=2))
    assert e.value.field == "routed_experts"


@pytest.mark.timeout(30)
def test_rollout_is_a_plain_dataclass():
    r = small()
    r2 = dataclasses.replace(r, rollout_id="other")
    assert decode(encode(r2)).rollout_id == "other"


def test_model_limits_refuse_what_the_model_cannot_take():
    from rlstream.common.record import RecordLimits

    r = realistic_rollout(response_tokens=8, prompt_tokens=4, layers=2, top_k=2, num_experts=8, vocab=64)
    buf = encode(r)
    assert decode(buf, RecordLimits.for_model(vocab_size=64, layers=2, top_k=2, experts=8)).rollout_id == r.rollout_id
    for limits, needle in ((RecordLimits.for_model(32, 2, 2, 8), "token ids"),
                           (RecordLimits.for_model(64, 3, 2, 8), "layers=2"),
                           (RecordLimits.for_model(64, 2, 4, 8), "top_k=2"),
                           (RecordLimits.for_model(64, 2, 2, 16), "num_experts=8")):
        with pytest.raises(InvalidRecordError, match=needle):
            decode(buf, limits)


def _pack_pairs(pairs) -> bytes:
    """A msgpack map written pair by pair (so a key may repeat, as a hostile or buggy client can)."""
    pk = msgpack.Packer(use_bin_type=True)
    return pk.pack_map_header(len(pairs)) + b"".join(pk.pack(k) + pk.pack(v) for k, v in pairs)


def test_a_repeated_key_is_refused_not_last_value_wins():
    m = msgpack.unpackb(encode(small()))
    pairs = list(m.items())
    assert decode(_pack_pairs(pairs)).reward == m["reward"]  # the same pairs, each key once: valid
    for key, second in (("reward", 5.0), ("logprobs", m["logprobs"]), ("schema", 1)):
        with pytest.raises(InvalidRecordError) as e:
            decode(_pack_pairs(pairs + [(key, second)]))
        assert e.value.field == key and "twice" in e.value.reason
    # nested maps too (reward_info, the claim-check pointer); an unknown key is not a field label
    nested = [(k, v) for k, v in pairs if k != "reward_info"] + [
        ("reward_info", {"correct": True})]
    raw = _pack_pairs(nested).replace(msgpack.packb({"correct": True}),
                                      _pack_pairs([("correct", True), ("correct", False)]))
    with pytest.raises(InvalidRecordError) as e:
        decode(raw)
    assert e.value.field == "<bytes>" and "'correct' appears twice" in e.value.reason
    p = ClaimPointer("rid", "gid", "file:///x/ab/" + "a" * 64, "a" * 64, 123)
    ptr = msgpack.unpackb(encode_claim_pointer(p))
    with pytest.raises(InvalidRecordError) as e:
        decode_any(_pack_pairs(list(ptr.items()) + [("group_id", "other")]))
    assert e.value.field == "group_id"


def test_temperature_round_trips_and_defaults_to_one():
    r = small()
    r.temperature = 0.7
    assert decode(encode(r)).temperature == pytest.approx(0.7)
    m = msgpack.unpackb(encode(small()))
    assert m["temperature"] == 1.0
    del m["temperature"]  # a record from before the key existed
    assert decode(msgpack.packb(m, use_bin_type=True)).temperature == 1.0


def test_consumer_limits_refuse_other_group_sizes_and_sequences_beyond_the_positions():
    r = small(response_tokens=12, prompt_tokens=5)  # group_size 8, P + T = 17
    buf = encode(r)
    assert decode(buf, RecordLimits(group_size=8, max_sequence_tokens=17)).rollout_id == r.rollout_id
    with pytest.raises(InvalidRecordError) as e:
        decode(buf, RecordLimits(group_size=4))
    assert e.value.field == "group_size" and "consumer.group_size 4" in e.value.reason
    with pytest.raises(InvalidRecordError) as e:
        decode(buf, RecordLimits(max_sequence_tokens=16))
    assert e.value.field == "response_ids" and "16 positions" in e.value.reason
    with pytest.raises(InvalidRecordError) as e:
        decode(buf, RecordLimits(max_sequence_tokens=5))
    assert e.value.field == "prompt_ids"
    assert RecordLimits.for_model(64, 2, 2, 8, positions=512).max_sequence_tokens == 512
