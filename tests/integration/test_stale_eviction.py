"""Engine-side stale eviction (producer/eviction.py) on the real service loop.

The producer service runs in this process on the session's vLLM CPU engine and a
real broker, with long responses (120 tokens) so its groups are still generating
when the bound moves. Twice, the in-flight groups become ones the consumer's gate
would drop: an operator lowers `max_staleness` on the control topic, then the
trainer announces a version far ahead. Each time, within a few loop passes, every
in-flight request is aborted in the engine, the group slots are free, the
eviction counters count them, and nothing evicted is published: the only records
are samples that ended on their own (end of text) before the pass that evicted.
"""
from __future__ import annotations

import time

import pytest

from rlstream.common import metrics
from rlstream.common.config import RlstreamConfig
from rlstream.common.control.messages import TrainerProgress
from tests.fixtures.kafka import make_kafka_settings
from tests.support.configs import ADMIN_TOKEN
from tests.support.topics import read_valid_rollouts

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, B, GROUPS, MAX_TOKENS = 2, 2, 4, 120


def _service(broker, tiny_model_dir, tmp_path, engine):
    from rlstream.common.control.plane import ControlPlaneWriter
    from rlstream.common.control.signing import signing_key
    from rlstream.toy.build import ensure_data
    from rlstream.producer.service import ProducerService

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs")
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 4},
        "producer": {"group_size": G, "max_groups_in_flight": GROUPS, "max_tokens": MAX_TOKENS,
                     "prompts": {"type": "jsonl", "path": str(tmp_path / "data" / "train.jsonl")},
                     "http": {"admin_token": ADMIN_TOKEN}},
        "consumer": {"group_size": G, "groups_per_batch": B}})
    ensure_data(cfg, n_train=32, n_heldout=4)
    writer = ControlPlaneWriter(kafka, signing_key(ADMIN_TOKEN))
    # the trainer at version 2, the engine at 0: within the bound of 4, admission fills the slots
    writer.announce(TrainerProgress(trainer_version=2, groups_per_batch=B, group_size=G))
    svc = ProducerService(cfg, broker.bootstrap)
    svc.start(engine=engine)
    return svc, kafka, writer


def _evicted() -> tuple[float, float]:
    return (metrics.value("rlstream_producer_evicted_groups_total") or 0,
            metrics.value("rlstream_producer_evicted_samples_total") or 0)


def _fill(svc) -> None:
    """Loop until every slot holds a group whose samples all sampled some tokens (none finished)."""
    deadline, tokens0 = time.monotonic() + 60, svc.engine.stats.generated_tokens  # a shared engine's stats add up
    while not (len(svc.groups) == GROUPS and svc.engine.num_in_flight == GROUPS * G
               and all(st.tokens for st in svc.engine._inflight.values())):
        assert time.monotonic() < deadline, (
            f"the producer did not fill its slots: {len(svc.groups)} groups, {svc.engine.num_in_flight} samples in "
            f"flight, {sum(1 for st in svc.engine._inflight.values() if st.tokens)} with tokens, engine version "
            f"{svc.engine.version}, held back: {svc.held_back()}, {svc.admission_view()}, ends {svc.topic_ends.current()}")
        svc.iterate()
    assert svc.engine.stats.generated_tokens - tokens0 < GROUPS * G * MAX_TOKENS  # still far from done


def _evicts_everything_in_flight(svc, change, applied) -> tuple[int, int]:
    """Apply `change`, loop until the service sees it (`applied`), then a few passes more:
    every in-flight group is aborted (not generated to the end). Returns the engine steps it
    took and how many samples ended on their own before the pass that evicted."""
    before, steps0 = _evicted(), svc.engine.stats.steps
    left = GROUPS * G * MAX_TOKENS - sum(len(st.tokens) for st in svc.engine._inflight.values())
    running = []  # samples in flight before each pass: a pass evicts before it steps the engine
    change()
    deadline = time.monotonic() + 30
    while not applied(svc):
        assert time.monotonic() < deadline, "the service did not see the change"
        running.append((len(svc.groups), svc.engine.num_in_flight))
        svc.iterate()
    for _ in range(3):
        running.append((len(svc.groups), svc.engine.num_in_flight))
        svc.iterate()
    assert svc.engine.num_in_flight == 0 and len(svc.groups) == 0,\
        f"{svc.engine.num_in_flight} samples still generating after the bound moved"
    assert not svc.engine.has_work()
    after = _evicted()
    # the pass that evicted found every group still in flight; a sample that ended on its own
    # before it (end of text, on a shared engine's weights) is a result, not an eviction
    at_eviction = next(n for g, n in reversed(running) if g == GROUPS)
    assert GROUPS <= at_eviction <= GROUPS * G
    assert (after[0] - before[0], after[1] - before[1]) == (GROUPS, at_eviction)
    steps = svc.engine.stats.steps - steps0
    print(f"\nevicted {GROUPS} groups {steps} engine steps after the change; about {left} tokens not generated")
    return steps, GROUPS * G - at_eviction


@pytest.mark.timeout(300)
def test_in_flight_groups_beyond_the_bound_are_aborted_and_counted(broker, rollout_engine, tiny_model_dir, tmp_path):
    svc, kafka, writer = _service(broker, tiny_model_dir, tmp_path, rollout_engine)
    try:
        _fill(svc)
        # an operator lowers the bound: 2 - 0 > 1, every group in flight is stale
        steps, ended = _evicts_everything_in_flight(
            svc, lambda: writer.set_control("max_staleness", 1, by="test"),
            lambda s: s.following.control.max_staleness == 1)
        assert steps < MAX_TOKENS // 2
        held = metrics.value("rlstream_producer_held_back_total", reason="staleness") or 0
        svc.iterate()  # and admission does not start new groups under the lower bound
        assert len(svc.groups) == 0 and metrics.value("rlstream_producer_held_back_total", reason="staleness") > held
        writer.set_control("max_staleness", 4, by="test")  # back to 4: the slots fill again
        _fill(svc)
        # the trainer runs ahead: 5 - 0 > 4
        steps, ended_too = _evicts_everything_in_flight(
            svc, lambda: writer.announce(TrainerProgress(trainer_version=5, groups_per_batch=B, group_size=G)),
            lambda s: s.following.progress.trainer_version == 5)
        assert steps < MAX_TOKENS // 2
        svc.outbox.drain(timeout_s=30)
    finally:
        svc.engine = None  # the session's: not ours to close
        svc.close()
        writer.close()
    # nothing evicted was published (an aborted sample would say "abort", one generated to the end
    # "length"): the records are samples that ended on their own at end of text, among them every
    # one that ended before a pass that evicted
    published = read_valid_rollouts(kafka)
    summary = [(r.group_id, r.sample_idx, r.finish_reason, r.response_ids.size) for r in published]
    assert all(r.finish_reason == "stop" and r.response_ids.size < MAX_TOKENS for r in published), summary
    assert len(published) >= ended + ended_too, summary
