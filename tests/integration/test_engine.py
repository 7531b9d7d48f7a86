"""RolloutEngine on the real vLLM CPU engine: shapes, dtypes, reloads, versions."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from rlstream.producer.rollout.trajectory import Trajectory
from tests.support.engine import run_until_done

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory):
    """Another tiny model (same shapes, other random weights): weight version 1."""
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-v1"), TinyModelSpec(seed=1))


@pytest.mark.timeout(300)
def test_groups_produce_well_formed_samples(rollout_engine):
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    groups = {"g-a": "12+7=", "g-b": "99-45=", "g-c": "3+4+5="}
    for tag, text in groups.items():
        ids = eng.submit_group(eng.encode(text), 4, SamplingConfig(max_tokens=32), tag=tag)
        assert ids == [f"{tag}/{i}" for i in range(4)]
    assert eng.num_in_flight == 12
    samples = run_until_done(eng)
    assert len(samples) == 12 and eng.num_in_flight == 0
    assert eng._capture.num_tracked == 0  # every finished request's rows were taken
    L, K, E = 2, 2, eng.num_experts
    for s in samples:
        P, T = s.prompt_ids.size, s.response_ids.size
        assert s.group_size == 4 and 0 <= s.sample_idx < 4
        assert eng.decode(s.prompt_ids) == groups[s.tag]
        assert s.prompt_ids.dtype == np.int32 and s.response_ids.dtype == np.int32
        assert s.logprobs.dtype == np.float32 and s.logprobs.shape == (T,)
        assert np.all(np.isfinite(s.logprobs)) and np.all(s.logprobs <= 0)
        assert s.routed_experts.dtype == np.uint8 and s.routed_experts.shape == (P + T - 1, L, K)
        assert int(s.routed_experts.max()) < E
        # top-k experts of one token are distinct
        assert np.all(s.routed_experts[:, :, 0] != s.routed_experts[:, :, 1])
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "length":
            assert T == 32
        else:
            assert s.response_ids[-1] == 1  # <eos>
        assert s.dispatch_version == 0 and s.token_versions == [(0, T)] and not s.weights_changed
    by_tag = {}
    for s in samples:
        by_tag.setdefault(s.tag, set()).add(s.sample_idx)
    assert by_tag == {t: {0, 1, 2, 3} for t in groups}
    # the prompt's routing rows are the same for every sample of a group
    g = [s for s in samples if s.tag == "g-a"]
    P = g[0].prompt_ids.size
    for s in g[1:]:
        np.testing.assert_array_equal(s.routed_experts[:P], g[0].routed_experts[:P])


@pytest.mark.timeout(300)
def test_reload_switches_version_and_greedy_outputs(rollout_engine, second_model_dir, tiny_model_dir):
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    greedy = SamplingConfig(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = eng.encode("25+17=")

    def one(tag):
        eng.submit_group(prompt, 1, greedy, tag=tag)
        (s,) = run_until_done(eng)
        return s

    base = one("v0")
    secs = eng.reload_weights(second_model_dir, 1)
    assert eng.version == 1
    other = one("v1")
    assert other.dispatch_version == 1 and other.token_versions == [(1, 24)]
    assert not np.array_equal(base.response_ids, other.response_ids)
    assert not np.allclose(base.logprobs, other.logprobs)
    eng.reload_weights(tiny_model_dir, 2)  # back to the first weights, new version number
    again = one("v2")
    np.testing.assert_array_equal(again.response_ids, base.response_ids)
    np.testing.assert_allclose(again.logprobs, base.logprobs, atol=1e-5)
    np.testing.assert_array_equal(again.routed_experts, base.routed_experts)
    print(f"\nreload_weights: {secs:.3f} s (tiny model)")


@pytest.mark.timeout(300)
def test_tokens_after_a_mid_sample_reload_carry_the_new_version(rollout_engine, second_model_dir):
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    greedy = SamplingConfig(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = eng.encode("60-18=")
    eng.submit_group(prompt, 1, greedy, tag="pure-v0")
    (pure,) = run_until_done(eng)

    eng.submit_group(prompt, 2, greedy, tag="mixed")
    for _ in range(5):  # step 1 prefills and samples token 1; steps 2..5 one token each
        assert eng.step() == []
    eng.reload_weights(second_model_dir, 7)
    mixed = run_until_done(eng)
    assert len(mixed) == 2
    for s in mixed:
        assert s.dispatch_version == 0
        assert s.token_versions == [(0, 5), (7, 15)]
        # the record carries the runs; staleness is measured from its oldest version
        record = Trajectory.of_sample(s).to_rollout("test", greedy)
        assert s.weights_changed and record.oldest_version == 0
        np.testing.assert_array_equal(record.token_versions, [[0, 5], [7, 15]])
        np.testing.assert_array_equal(s.response_ids[:5], pure.response_ids[:5])
        assert not np.array_equal(s.response_ids[5:], pure.response_ids[5:])
        assert s.routed_experts.shape[0] == s.prompt_ids.size + 19


@pytest.mark.timeout(300)
def test_abort_all_drops_in_flight_samples(rollout_engine):
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    eng.submit_group(eng.encode("1+1="), 3, SamplingConfig(max_tokens=50, ignore_eos=True), tag="ab")
    eng.step()
    eng.step()
    assert eng.num_in_flight == 3
    assert eng.abort_all() == 3
    assert eng.num_in_flight == 0 and eng._capture.num_tracked == 0
    for _ in range(5):
        assert eng.step() == []
    assert not eng.has_work()


@pytest.mark.timeout(300)
def test_abort_tag_drops_one_group_and_oldest_versions_follow_first_tokens(rollout_engine, second_model_dir):
    """Stale eviction's engine side: a group's oldest version is its first sampled token's
    (the version now while none is sampled); aborting one tag leaves the others whole."""
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    sampling = SamplingConfig(max_tokens=12, ignore_eos=True)
    for tag in ("keep", "drop"):
        eng.submit_group(eng.encode("1+1="), 3, sampling, tag=tag)
    while not all(st.tokens for st in eng._inflight.values()):
        eng.step()
    eng.reload_weights(second_model_dir, 1)
    eng.submit_group(eng.encode("2+2="), 2, sampling, tag="late")  # nothing sampled yet: version 1
    assert eng.oldest_versions() == {"keep": 0, "drop": 0, "late": 1}
    assert eng.abort_tag("drop") == 3 and eng.abort_tag("drop") == 0
    assert eng._capture.num_tracked <= 5  # the aborted requests' rows are gone
    done = run_until_done(eng)
    assert sorted(s.tag for s in done) == ["keep"] * 3 + ["late"] * 2
    for s in done:  # the other groups finished with every routing row
        assert s.routed_experts.shape[0] == s.prompt_ids.size + s.response_ids.size - 1
    assert not eng.has_work()


@pytest.mark.timeout(300)
def test_a_sampled_group_is_one_vllm_request_and_a_greedy_group_n(rollout_engine):
    """At temperature > 0 a group is one vLLM request that vLLM fans out into n (its inputs
    processed once); vLLM refuses n > 1 for greedy sampling, so a greedy group is n requests
    of one. Either way each sample finishes on its own as "{tag}/{i}"."""
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    eng.submit_group(eng.encode("12+7="), 4, SamplingConfig(max_tokens=8), tag="fan")
    eng.submit_group(eng.encode("12+7="), 3, SamplingConfig(max_tokens=8, temperature=0.0), tag="greedy")
    vllm_requests = eng._engine.output_processor.external_req_ids  # vLLM's id -> its engine-core ids
    assert sorted(vllm_requests) == ["fan/*", "greedy/0", "greedy/1", "greedy/2"]
    assert sorted(vllm_requests["fan/*"]) == sorted(eng._inflight[f"fan/{i}"].internal_id for i in range(4))
    done = run_until_done(eng)
    assert sorted((s.tag, s.sample_idx) for s in done) == [("fan", i) for i in range(4)] + [("greedy", i)
                                                                                             for i in range(3)]
    assert len({s.response_ids.tobytes() for s in done if s.tag == "greedy"}) == 1
    for s in done:
        assert s.request_id == f"{s.tag}/{s.sample_idx}" and s.response_ids.size == s.logprobs.size > 0
        assert s.routed_experts.shape[0] == s.prompt_ids.size + s.response_ids.size - 1
    assert not eng.has_work()


@pytest.mark.timeout(120)
def test_misuse_is_refused(rollout_engine):
    from rlstream.common.errors import EngineError
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    with pytest.raises(EngineError, match="max_model_len"):
        eng.submit_group(np.ones(250, np.int32) * 5, 1, SamplingConfig(max_tokens=64), tag="long")
    with pytest.raises(EngineError, match="chunked_prefill"):
        eng.submit_group(eng.encode("1+2="), 2, SamplingConfig(seed=3), tag="seeded")
    eng.submit_group(eng.encode("1+2="), 1, SamplingConfig(max_tokens=4), tag="dup")
    with pytest.raises(EngineError, match="already in flight"):
        eng.submit_group(eng.encode("1+2="), 1, SamplingConfig(max_tokens=4), tag="dup")
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(EngineError, eng.step)))
    t.start()
    t.join(30)
    assert errors and errors[0].match("single-threaded")
    with pytest.raises(EngineError, match="does not exist"):
        eng.reload_weights("/nonexistent/weights", 3)
    assert eng.version == 0


@pytest.mark.timeout(300)
def test_decode_throughput(rollout_engine):
    """Figure for the report (asserted loosely): 32 samples x 64 tokens."""
    from rlstream.producer.sample import SamplingConfig

    eng = rollout_engine
    before_tok, before_s = eng.stats.generated_tokens, eng.stats.step_seconds
    for g in range(8):
        eng.submit_group(eng.encode(f"{g}+{g}="), 4, SamplingConfig(max_tokens=64, ignore_eos=True), tag=f"tp{g}")
    samples = run_until_done(eng)
    toks = eng.stats.generated_tokens - before_tok
    secs = eng.stats.step_seconds - before_s
    assert toks == 32 * 64 == sum(s.response_ids.size for s in samples)
    print(f"\nthroughput: {toks} tokens in {secs:.2f} s of engine steps = {toks / secs:.0f} tokens/s "
          f"(engine start {eng.stats.start_seconds:.1f} s)")
    assert toks / secs > 50
