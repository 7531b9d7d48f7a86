"""Trajectory -> Rollout (producer/rollout/trajectory.py `to_rollout`): the one conversion
of every record, checked by encoding (which validates) and decoding the record, and
byte for byte against the two builders it replaced (a single sample's, an episode's),
kept here verbatim as they were before the rollout driver."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlstream.common.record import FINISH_REASONS, Rollout, decode, encode, routing_dtype_for
from rlstream.producer.rollout.trajectory import FINISH, Trajectory
from rlstream.producer.sample import FinishedSample, SamplingConfig


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


def to_rollout(s: FinishedSample, reward: float, info: dict, producer_id: str, sampling: SamplingConfig,
               prompt_text: str | None = None) -> Rollout:
    """A single-turn record, as producer/rollout/single_turn.py builds it."""
    t = Trajectory.of_sample(s)
    t.reward, t.info = reward, info
    return t.to_rollout(producer_id, sampling, prompt_text)


def test_to_rollout_maps_every_field_and_encodes():
    s = sample()
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, top_p=1.0)
    r = to_rollout(s, 1.0, {"parsed": "19", "correct": True, "nested": {"x": 1}}, "p0", sampling, prompt_text="12+7=")
    assert (r.group_id, r.sample_idx, r.group_size, r.producer_id) == ("p0-abc-1", 1, 4, "p0")
    assert r.policy_version == 3 and r.oldest_version == 3 and r.token_versions is None  # one run: implied
    assert r.reward == 1.0 and r.reward_info == {"parsed": "19", "correct": True}  # scalars only
    assert r.logprobs.max() == 0.0  # +1e-8 rounding clamped: the record refuses positive log-probs
    assert r.num_experts == 8 and r.prompt_text == "12+7=" and r.finish_reason == "stop"
    assert r.sampling_digest == "t=1.0,p=1.0,max=16" and r.model_digest == "v3"
    back = decode(encode(r))
    np.testing.assert_array_equal(back.routed_experts, s.routed_experts)
    assert back.routed_experts.dtype == routing_dtype_for(8)
    assert to_rollout(s, 0.0, {}, "p0", sampling).rollout_id != r.rollout_id  # fresh id per record
    assert r.temperature == 1.0
    hot = decode(encode(to_rollout(s, 1.0, {}, "p0", SamplingConfig(max_tokens=16, temperature=1.3))))
    assert hot.temperature == pytest.approx(1.3)  # the trainer applies the record's temperature


def test_a_reload_mid_sample_travels_as_runs_and_sets_staleness():
    s = sample(dispatch_version=3, token_versions=[(3, 1), (5, 3)])
    r = decode(encode(to_rollout(s, 0.0, {}, "p0", SamplingConfig())))
    assert s.weights_changed and r.oldest_version == 3 and r.policy_version == 3
    np.testing.assert_array_equal(r.token_versions, [[3, 1], [5, 3]])


def test_no_routing_and_unknown_finish_reasons():
    r = decode(encode(to_rollout(sample(routed_experts=None, finish_reason="timeout"), 0.0, {}, "p0",
                                 SamplingConfig())))
    assert r.routed_experts is None and r.num_experts == 0 and r.finish_reason == "stop"


def test_routing_dtype_rule_is_the_records():
    assert routing_dtype_for(256) == np.uint8 and routing_dtype_for(257) == np.uint16


# ------------------------------------------------- byte for byte, against the builders it replaced

def legacy_sample_record(s: FinishedSample, reward: float, info: dict, producer_id: str, sampling: SamplingConfig,
                         prompt_text: str | None = None) -> Rollout:
    """producer/sample.py `FinishedSample.to_rollout` before the rollout driver (5fd07df), verbatim."""
    tv = np.asarray(s.token_versions, dtype=np.int64) if s.weights_changed else None
    return Rollout(
        rollout_id=Rollout.new_id(), group_id=s.tag, sample_idx=s.sample_idx,
        group_size=s.group_size, prompt_ids=s.prompt_ids, response_ids=s.response_ids,
        logprobs=np.minimum(s.logprobs, 0.0), policy_version=s.dispatch_version,
        reward=float(reward),
        finish_reason=s.finish_reason if s.finish_reason in FINISH_REASONS else "stop",
        producer_id=producer_id, prompt_text=prompt_text, token_versions=tv,
        routed_experts=s.routed_experts,
        num_experts=s.num_experts if s.routed_experts is not None else 0,
        reward_info={k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))},
        sampling_digest=sampling.digest, model_digest=f"v{s.dispatch_version}",
        temperature=float(sampling.temperature))


def legacy_episode_record(t: Trajectory, end: str, producer_id: str, sampling: SamplingConfig,
                          prompt_text: str | None) -> Rollout:
    """producer/episodes.py `EpisodeState.to_finished(end).to_rollout(...)` before the rollout
    driver (5fd07df), verbatim but for reading the trajectory (its per-token versions from its runs)."""
    versions = np.repeat(t.version_runs[:, 0], t.version_runs[:, 1])  # the runner's per-token list
    loss_mask = t.loss_mask
    change = np.flatnonzero(np.diff(versions)) + 1
    starts = np.r_[0, change]
    counts = np.diff(np.r_[starts, versions.size])
    runs = np.stack([versions[starts], counts], 1).astype(np.int64)
    info = {k: v for k, v in t.info.items() if isinstance(v, (str, int, float, bool))}
    info.update(end=end, turns=t.turns)
    return Rollout(
        rollout_id=Rollout.new_id(), group_id=t.group_id, sample_idx=t.sample_idx,
        group_size=t.group_size, prompt_ids=np.asarray(t.prompt_ids, dtype=np.int32),
        response_ids=t.response_ids, logprobs=t.logprobs, policy_version=int(versions[0]),
        reward=float(t.reward), finish_reason=FINISH[end], producer_id=producer_id, prompt_text=prompt_text,
        token_versions=runs if len(runs) > 1 else None, routed_experts=t.routing,
        num_experts=t.num_experts if t.routing is not None else 0,
        reward_info=info, sampling_digest=sampling.digest, model_digest=f"v{int(versions[0])}",
        temperature=float(sampling.temperature),
        loss_mask=None if loss_mask.all() else loss_mask)


def same_bytes(a: Rollout, b: Rollout) -> bool:
    """Equal encodings once the two per-record fields (fresh id, creation time) agree."""
    b = dataclasses.replace(b, rollout_id=a.rollout_id, created_at=a.created_at)
    return encode(a) == encode(b)


SAMPLES = {
    "one run": sample(),
    "a reload mid-sample": sample(token_versions=[(3, 1), (5, 3)]),
    "no routing, unknown finish": sample(routed_experts=None, finish_reason="timeout"),
    "reloaded before its first token": sample(token_versions=[(5, 4)]),  # the record keeps the dispatch version
    "cut at max_tokens": sample(finish_reason="length", logprobs=np.array([-0.5, -1e-3, -2.0, 0.0], np.float32)),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_single_turn_record_is_byte_identical_to_the_sample_builder_it_replaced(name):
    s = SAMPLES[name]
    sampling = SamplingConfig(max_tokens=16, temperature=0.7, top_p=0.9)
    for info in ({}, {"parsed": "19", "correct": True, "nested": {"x": 1}}):
        new = to_rollout(s, 1.0, info, "p0", sampling, prompt_text="12+7=")
        assert new.loss_mask is None  # schema 1
        assert same_bytes(new, legacy_sample_record(s, 1.0, info, "p0", sampling, prompt_text="12+7="))


def turn(ids, version, rows=None, finish="stop") -> FinishedSample:
    """One model turn of an episode: `ids` sampled at `version` (runs: [(version, count)])."""
    ids = np.asarray(ids, np.int32)
    runs = version if isinstance(version, list) else [(version, ids.size)]
    return sample(response_ids=ids, logprobs=np.linspace(0.0, -1.0, ids.size).astype(np.float32),
                  token_versions=runs, routed_experts=rows, finish_reason=finish, dispatch_version=runs[0][0])


def episode(observation: bool) -> Trajectory:
    """Two model turns (a reload within the second), with an environment's tokens between them or not."""
    L, K = 2, 2
    t = Trajectory("g-1", 2, 4, prompt_ids=np.array([5, 6, 7], np.int32))
    # dispatched at 2, sampled at 3 (a reload before its first token): the record keeps the first token's
    t.add_model_turn(dataclasses.replace(turn([8, 9], 3, rows=np.full((3 + 2 - 1, L, K), 1, np.uint8)),
                                         dispatch_version=2))
    if observation:
        t.add_observation([11, 12, 13], version=3)
    n = t.num_tokens
    t.add_model_turn(turn([14, 15, 1], [(3, 1), (4, 2)], rows=np.full((3 + n + 3 - 1, L, K), 2, np.uint8)))
    t.reward, t.info = 0.5, {"tool_calls": 1, "nested": [1]}
    return t


@pytest.mark.parametrize("observation", [True, False])
@pytest.mark.parametrize("end", ["done", "max_turns", "env_error", "verified"])
def test_an_episode_record_is_byte_identical_to_the_episode_builder_it_replaced(observation, end):
    t = episode(observation)
    sampling = SamplingConfig(max_tokens=8, temperature=1.0)
    legacy = legacy_episode_record(t, end, "p0", sampling, "37+48-19=")
    t.end = end
    new = t.to_rollout("p0", sampling, "37+48-19=")
    assert same_bytes(new, legacy)
    back = decode(encode(new))
    assert (back.loss_mask is None) == (not observation)  # schema 1 exactly when every token is the model's
    assert back.token_versions.tolist() == ([[3, 6], [4, 2]] if observation else [[3, 3], [4, 2]])
    assert back.reward_info == {"tool_calls": 1, "end": end, "turns": 2}
