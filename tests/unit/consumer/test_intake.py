"""consumer/stream/intake.py: what the consumer refuses before the ledger (the reader DLQs it)."""
from __future__ import annotations

import numpy as np
import pytest

from rlstream.common.errors import InvalidRecordError
from rlstream.common.record import Rollout, decode, encode
from rlstream.consumer.stream.intake import FUTURE_VERSION_SLACK, VersionBound, record_limits
from rlstream.consumer.train.model import HFModelDims
from tests.support.fakes import Clock


def roll(version: int = 0, tv=None, P: int = 2, T: int = 1, G: int = 4) -> Rollout:
    return Rollout(rollout_id="r", group_id="g", sample_idx=0, group_size=G,
                   prompt_ids=np.full(P, 1, np.int32), response_ids=np.full(T, 3, np.int32),
                   logprobs=np.full(T, -0.5, np.float32), policy_version=version, reward=1.0,
                   token_versions=None if tv is None else np.asarray(tv, np.int64))


def test_versions_up_to_the_newest_announced_pass_later_ones_are_refused():
    newest = {"v": 7}
    check = VersionBound(lambda: newest["v"])
    assert FUTURE_VERSION_SLACK == 0
    check(roll(7))
    check(roll(5, tv=[[5, 1]]))
    with pytest.raises(InvalidRecordError) as e:
        check(roll(1007))  # "trainer + 1000": would be trained with staleness 0
    assert e.value.field == "policy_version" and "future" in e.value.reason
    with pytest.raises(InvalidRecordError) as e:
        check(roll(6, tv=[[6, 1], [9, 1]], T=2))  # a later token run from the future
    assert e.value.field == "token_versions"
    newest["v"] = 9  # the bound follows the service's newest version
    check(roll(6, tv=[[6, 1], [9, 1]], T=2))
    with pytest.raises(InvalidRecordError):
        VersionBound(lambda: 7, slack=2)(roll(10))
    VersionBound(lambda: 7, slack=2)(roll(9))


def test_record_limits_carry_the_models_positions_and_the_group_size():
    dims = HFModelDims(vocab_size=64, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                       moe_ffn_hidden_size=8, num_experts=8, topk=2, rms_norm_eps=1e-6, rope_theta=1e4,
                       tie_word_embeddings=False, max_position_embeddings=512)
    limits = record_limits(dims, group_size=4)
    assert (limits.max_token_id, limits.model_layers, limits.model_top_k, limits.model_experts,
            limits.max_sequence_tokens, limits.group_size) == (63, 2, 2, 8, 512, 4)
    assert decode(encode(roll(P=500, T=12)), limits).group_size == 4
    for r, field in ((roll(P=600, T=4), "prompt_ids"), (roll(P=500, T=13), "response_ids"),
                     (roll(G=8), "group_size")):
        with pytest.raises(InvalidRecordError) as e:
            decode(encode(r), limits)
        assert e.value.field == field


def test_intake_starved_only_when_polls_return_nothing_while_records_wait_and_no_step():
    from rlstream.consumer.stream.intake import IntakeWatch

    clock = Clock(100.0)
    w = IntakeWatch(60.0, "rlstream.rollouts", clock=clock, export=False)
    w.fetch_wait_ms = 5000
    w.read(0, 0)  # nothing waits: idle, never starved
    clock.t += 600
    assert w.reasons() == [] and w.starved_s() == 0.0
    w.read(0, 869)  # records wait, the poll got none: the clock starts
    clock.t += 30
    w.read(0, 869)
    assert w.starved_s() == 30.0 and w.reasons() == []
    clock.t += 31
    (why,) = w.reasons()
    assert "869 records wait in rlstream.rollouts" in why and "61 s" in why and "fetch wait 5000 ms" in why
    w.read(3, 866)  # records arrive: not starved
    assert w.reasons() == []
    w.read(0, 866)
    clock.t += 600  # a long train step between two empty polls starts no clock of its own ...
    w.stepped()  # ... and a step clears it
    w.read(0, 866)
    clock.t += 59
    assert w.reasons() == []


def test_the_version_bound_is_the_trainers_own_not_the_policy_topics():
    """A WeightsReady a million versions ahead on the policy topic (anyone who can write it) must not
    open the reader to records from that future: the bound is the version this trainer has made."""
    from types import SimpleNamespace

    from rlstream.common.control.messages import WeightsReady
    from rlstream.consumer.service import ConsumerService

    forged = WeightsReady(version=1_000_000, transport="collective", digest="f" * 64, endpoint="10.9.9.9:1",
                          backend="rlstream_gloo")
    service = SimpleNamespace(version=7, follower=SimpleNamespace(view=SimpleNamespace(weights=forged)))
    assert ConsumerService.newest_version(service) == 7
