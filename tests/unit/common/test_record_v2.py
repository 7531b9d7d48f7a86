"""Schema v2 (multi-turn): loss mask, environment tokens, v1 still read as an all-model mask."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rlstream.common.errors import InvalidRecordError
from rlstream.common.record import Rollout, decode, encode
from tests.fixtures.kafka import realistic_rollout

# model turn (4) | env turn (3) | model turn (3) | env turn (2)
MASK = np.array([1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0], dtype=bool)


def multi_turn(**kw) -> Rollout:
    r = realistic_rollout(response_tokens=12, prompt_tokens=5, layers=3, top_k=2, num_experts=8, **kw)
    r.loss_mask = MASK.copy()
    lp = np.array(r.logprobs)
    lp[~MASK] = 0.0
    r.logprobs = lp
    # version 3 for turn 1, 4 appended with env turn 1, turn 2 sampled at 4 then 5 (mid-turn reload)
    r.token_versions = np.array([[3, 4], [4, 5], [5, 3]], dtype=np.int64)
    return r


@pytest.mark.timeout(30)
def test_v2_round_trips_with_its_mask_and_zero_env_logprobs():
    r = multi_turn()
    buf = encode(r)
    assert msgpack.unpackb(buf)["schema"] == 2
    back = decode(buf)
    assert back.loss_mask.dtype == bool and np.array_equal(back.loss_mask, MASK)
    assert not back.loss_mask.flags.writeable  # zero-copy view like every array
    assert np.array_equal(back.logprobs, r.logprobs) and (back.logprobs[~MASK] == 0).all()
    assert back.num_model_tokens == 7 and np.array_equal(back.model_mask, MASK)
    assert np.array_equal(back.token_versions, r.token_versions)
    assert back.routed_experts.shape == (5 + 12 - 1, 3, 2)  # every input position, env ones included


@pytest.mark.timeout(30)
def test_a_record_without_env_tokens_is_written_as_v1_and_reads_as_an_all_model_mask():
    single = realistic_rollout(response_tokens=12, prompt_tokens=5, layers=3, top_k=2, num_experts=8)
    buf = encode(single)
    assert msgpack.unpackb(buf)["schema"] == 1 and "loss_mask" not in msgpack.unpackb(buf)
    v1 = decode(buf)
    assert v1.loss_mask is None and v1.model_mask.all() and v1.num_model_tokens == 12
    single.loss_mask = np.ones(12, dtype=bool)  # the same sample written as v2
    v2 = decode(encode(single))
    assert np.array_equal(v1.model_mask, v2.model_mask)
    assert v1.oldest_version == v2.oldest_version


@pytest.mark.timeout(30)
def test_oldest_version_counts_model_tokens_only():
    r = multi_turn()
    r.token_versions = np.array([[3, 4], [1, 3], [4, 5]], dtype=np.int64)  # env turn 1 "older" (never sampled)
    r.policy_version = 3
    assert r.oldest_version == 3
    r.token_versions = np.array([[3, 4], [4, 3], [2, 5]], dtype=np.int64)
    r.policy_version = 3
    assert r.oldest_version == 2


def _set_mask(mask):
    def f(r):
        r.loss_mask = mask
    return f


def _env_logprob(r):
    lp = np.array(r.logprobs)
    lp[5] = -0.25
    r.logprobs = lp


ENCODE_RULES = [
    ("mask too short", _set_mask(MASK[:-1].copy()), "loss_mask"),
    ("mask too long", _set_mask(np.ones(13, dtype=bool)), "loss_mask"),
    ("mask uint8 in memory", _set_mask(MASK.astype(np.uint8)), "loss_mask"),
    ("mask 2-d", _set_mask(MASK.reshape(2, 6)), "loss_mask"),
    ("starts with env", _set_mask(np.r_[False, MASK[1:]]), "loss_mask"),
    ("all env", _set_mask(np.zeros(12, dtype=bool)), "loss_mask"),
    ("log-prob on env token", _env_logprob, "logprobs"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what,mutate,field", ENCODE_RULES, ids=[r[0] for r in ENCODE_RULES])
def test_encode_refuses_inconsistent_masks(what, mutate, field):
    r = multi_turn()
    encode(r)
    mutate(r)
    with pytest.raises(InvalidRecordError) as e:
        encode(r)
    assert e.value.field == field, str(e.value)


def _wire(**changes) -> bytes:
    m = msgpack.unpackb(encode(multi_turn()))
    for k, v in changes.items():
        if v is KeyError:
            m.pop(k)
        else:
            m[k] = v
    return msgpack.packb(m, use_bin_type=True)


def _lp_bytes(fn) -> bytes:
    lp = np.array(multi_turn().logprobs)
    fn(lp)
    return lp.astype("<f4").tobytes()


WIRE_RULES = [
    ("mask missing in v2", _wire(loss_mask=KeyError), "loss_mask"),
    ("mask a list", _wire(loss_mask=[1] * 12), "loss_mask"),
    ("mask value 2", _wire(loss_mask=bytes([1, 2] + [1] * 10)), "loss_mask"),
    ("mask value 255", _wire(loss_mask=bytes([255] * 12)), "loss_mask"),
    ("mask short", _wire(loss_mask=bytes([1] * 11)), "loss_mask"),
    ("mask starts with env", _wire(loss_mask=bytes([0] + [1] * 11)), "loss_mask"),
    ("mask all env", _wire(loss_mask=bytes(12)), "loss_mask"),
    ("log-prob on env token", _wire(logprobs=_lp_bytes(lambda a: a.__setitem__(4, -1.0))), "logprobs"),
    ("v1 carrying a mask", _wire(schema=1), "loss_mask"),
    ("schema 2 float", _wire(schema=2.0), "schema"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what,buf,field", WIRE_RULES, ids=[r[0] for r in WIRE_RULES])
def test_decode_refuses_hostile_v2_naming_the_field(what, buf, field):
    """An InvalidRecordError naming the field is what the reader turns into a dead letter
    (common/kafka/reader.py; tests/integration/test_reader_fuzz.py for the broker path)."""
    with pytest.raises(InvalidRecordError) as e:
        decode(buf)
    assert e.value.field == field, str(e.value)
