"""FinishedSample -> Rollout (producer/sample.py `to_rollout`): the one conversion,
checked by encoding (which validates) and decoding the record."""
from __future__ import annotations

import numpy as np
import pytest

from common.record import decode, encode, routing_dtype_for
from producer.sample import FinishedSample, SamplingConfig


def sample(**changes) -> FinishedSample:
    P, T, L, K = 3, 4, 2, 2
    fields = dict(
        tag="p0-abc-1", sample_idx=1, group_size=4, request_id="p0-abc-1/1",
        prompt_ids=np.array([5, 6, 7], np.int32), response_ids=np.array([8, 9, 10, 1], np.int32),
        logprobs=np.array([-0.5, 1e-8, -2.0, -0.1], np.float32), finish_reason="stop", stop_reason=1,
        dispatch_version=3, token_versions=[(3, T)],
        routed_experts=np.arange((P + T - 1) * L * K, dtype=np.uint8).reshape(P + T - 1, L, K) % 8,
        num_experts=8, logprobs_mode="processed_logprobs", submitted_at=1.0, finished_at=2.0)
    fields.update(changes)
    return FinishedSample(**fields)


def test_to_rollout_maps_every_field_and_encodes():
    s = sample()
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, top_p=1.0)
    r = s.to_rollout(1.0, {"parsed": "19", "correct": True, "nested": {"x": 1}}, "p0", sampling, prompt_text="12+7=")
    assert (r.group_id, r.sample_idx, r.group_size, r.producer_id) == ("p0-abc-1", 1, 4, "p0")
    assert r.policy_version == 3 and r.oldest_version == 3 and r.token_versions is None  # one run: implied
    assert r.reward == 1.0 and r.reward_info == {"parsed": "19", "correct": True}  # scalars only
    assert r.logprobs.max() == 0.0  # +1e-8 rounding clamped: the record refuses positive log-probs
    assert r.num_experts == 8 and r.prompt_text == "12+7=" and r.finish_reason == "stop"
    assert r.sampling_digest == "t=1.0,p=1.0,max=16" and r.model_digest == "v3"
    back = decode(encode(r))
    np.testing.assert_array_equal(back.routed_experts, s.routed_experts)
    assert back.routed_experts.dtype == routing_dtype_for(8)
    assert s.to_rollout(0.0, {}, "p0", sampling).rollout_id != r.rollout_id  # fresh id per record
    assert r.temperature == 1.0
    hot = decode(encode(s.to_rollout(1.0, {}, "p0", SamplingConfig(max_tokens=16, temperature=1.3))))
    assert hot.temperature == pytest.approx(1.3)  # the trainer applies the record's temperature


def test_a_reload_mid_sample_travels_as_runs_and_sets_staleness():
    s = sample(dispatch_version=3, token_versions=[(3, 1), (5, 3)])
    r = decode(encode(s.to_rollout(0.0, {}, "p0", SamplingConfig())))
    assert s.weights_changed and r.oldest_version == 3 and r.policy_version == 3
    np.testing.assert_array_equal(r.token_versions, [[3, 1], [5, 3]])


def test_no_routing_and_unknown_finish_reasons():
    r = decode(encode(sample(routed_experts=None, finish_reason="timeout").to_rollout(0.0, {}, "p0",
                                                                                     SamplingConfig())))
    assert r.routed_experts is None and r.num_experts == 0 and r.finish_reason == "stop"


def test_routing_dtype_rule_is_the_records():
    assert routing_dtype_for(256) == np.uint8 and routing_dtype_for(257) == np.uint16
