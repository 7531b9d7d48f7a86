"""Durable partial episodes (producer/journal/) on the real vLLM engine and broker.

Producer `a` runs multi-turn episodes until some are between turns, then crashes:
no drain, no SIGTERM path; its engine requests are aborted, its lease stops and its
clients close (what the broker got stays, nothing more is written). Producer `b`
starts on the same engine (the session's: a second engine start would cost ~40 s), sees
a's lease lapse (lease_s = 1 s), claims a's unfinished episodes and finishes them. Then:
every episode is published exactly once, a's groups are complete and assemble as one
copy each (consumer/stream/assembler.py), and each resumed record starts with exactly the
tokens, log-probs, mask and versions a had generated up to its last completed turn.
Without the journal a's in-flight episodes are never published and its groups stay
incomplete. The environment answers every model turn for 3 turns (the random tiny
model never calls the calculator's tool) and, like the calculator, replays.
tests/bench/episodes.py does the same with SIGKILLed producer processes.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.fixtures.kafka import make_kafka_settings
from tests.support.journaled_episodes import G, Turns, config, crash, journaled, resume_on_b, run_until
from tests.support.topics import announce_trainer_start, read_valid_rollouts

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

@pytest.mark.timeout(300)  # with the session engine's start when run alone (8-10 s of its own)
def test_a_crashed_producers_episodes_are_resumed_and_published_exactly_once(broker, rollout_engine, tiny_model_dir,
                                                                            tmp_path, monkeypatch):
    run_crash(broker, rollout_engine, tiny_model_dir, tmp_path, monkeypatch, journal=True)


def run_crash(broker, engine, model_dir, tmp_path, monkeypatch, journal: bool) -> None:
    """a crashes with episodes between turns, b resumes them; every episode is published once."""
    from rlstream.common.tasks import envs
    from rlstream.toy.build import ensure_data

    monkeypatch.setitem(envs.ENVIRONMENTS, "calculator", Turns)
    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    data = tmp_path / "data" / "train.jsonl"
    ensure_data(config(kafka, model_dir, data, "a", journal), n_train=64, n_heldout=8)
    announce_trainer_start(kafka, groups_per_batch=2, group_size=G)
    durable = crash_a_between_turns(broker, engine, kafka, model_dir, data, journal)
    published0 = resume_on_b(broker, engine, config(kafka, model_dir, data, "b", journal), journal, len(durable))
    records = read_valid_rollouts(kafka)
    if journal:  # a published some records whose entries stayed: b found them in the topic
        from rlstream.common import metrics
        assert (metrics.value("rlstream_producer_resumed_episodes_total", outcome="published") or 0) > published0
    check_each_episode_once_in_complete_groups(records)
    check_resumed_from_the_journal(records, durable)


def crash_a_between_turns(broker, engine, kafka, model_dir, data, journal: bool) -> dict:
    """Producer a runs until two episodes are past their first turn, then crashes; the journal's
    entries (key -> Snapshot), each holding what a generated up to its last completed turn."""
    from rlstream.producer.service import ProducerService

    a = ProducerService(config(kafka, model_dir, data, "a", journal), broker.bootstrap)
    a.start(engine=engine)
    runner = a.driver.runner
    acked = []
    if journal:  # a "dies" after each record's acknowledgement, before its tombstone: the entries
        runner.journal.on_delivered = acked.append  # stay, and b must not publish them again
    mid = lambda: [ep for ep in runner._turns.values() if ep.turns >= 1]  # noqa: E731 - between turns
    run_until(a, lambda: len(mid()) >= 2 and a.outbox.unacked_records == 0 and (acked or not journal), 60,
              "episodes past their first turn (and, with the journal, a record acknowledged)")
    alive = list(runner._turns.values()) + [ep for ep, _, _ in runner._pending.values()]
    generated = {f"ep:{ep.group_id}#{ep.sample_idx}": ep.response_ids.tolist() for ep in alive}
    between_turns = {f"ep:{ep.group_id}#{ep.sample_idx}" for ep in mid()}
    crash(a, engine)
    durable = journaled(kafka)
    assert not journal or {k for k, s in durable.items() if s.turns >= 1} >= between_turns
    for key, s in durable.items():  # the journal holds what a generated, up to its last completed turn
        assert s.holder == "a" and (key not in generated or generated[key][:s.response.size] == s.response.tolist())
    return durable


def check_each_episode_once_in_complete_groups(records) -> None:
    """Each episode once; a's groups complete, in a's copy, and they assemble."""
    from rlstream.consumer.stream.assembler import GroupAssembler

    assert Counter((r.group_id, r.sample_idx) for r in records).most_common(1)[0][1] == 1  # each once
    assert len({r.rollout_id for r in records}) == len(records)
    of_a = [r for r in records if r.group_id.startswith("a-")]
    assert all(r.producer_id == "a" for r in of_a)  # a's copy, whoever finished the episode
    sizes = Counter(r.group_id for r in of_a)
    assert set(sizes.values()) == {G}, f"a's groups incomplete: {sizes}"
    assembler = GroupAssembler(G, timeout_s=600)
    assert {assembler.add(r, 0, i).outcome for i, r in enumerate(of_a)} <= {"held", "completed"}


def check_resumed_from_the_journal(records, durable: dict) -> None:
    """Each resumed record starts with the tokens, log-probs, mask and versions of its entry."""
    by_key = {f"ep:{r.group_id}#{r.sample_idx}": r for r in records}
    resumed = [k for k, s in durable.items() if s.turns >= 1]
    assert len(resumed) >= 2
    for key in resumed:
        s, r = durable[key], by_key[key]
        n = s.response.size
        assert r.rollout_id == s.rollout_id and r.response_ids[:n].tolist() == s.response.tolist()
        assert np.array_equal(r.logprobs[:n], s.logprobs) and r.model_mask[:n].tolist() == s.mask.tolist()
        versions = np.repeat(r.token_versions[:, 0], r.token_versions[:, 1]) if r.token_versions is not None\
            else np.full(r.num_tokens, r.policy_version)
        assert versions[:n].tolist() == s.versions.tolist() and r.reward == 1.0


@pytest.mark.timeout(120)
def test_the_resumer_finds_a_published_record_from_the_journaled_offsets(broker, tmp_path):
    """producer/journal/published.py on the broker: a record at or after the bound is found,
    a claim-check pointer names its rollout id, one before the bound or never sent is not."""
    from rlstream.common.kafka.claimcheck import BlobStore
    from rlstream.common.kafka.client import ensure_topics
    from rlstream.common.kafka.publisher import RolloutPublisher
    from rlstream.common.record import Rollout
    from rlstream.producer.journal.published import published

    def rollout(group: str, n: int) -> Rollout:
        return Rollout(rollout_id=Rollout.new_id(), group_id=group, sample_idx=0, group_size=1,
                       prompt_ids=np.array([1, 2], np.int32), response_ids=np.arange(n, dtype=np.int32),
                       logprobs=np.zeros(n, np.float32), policy_version=0, reward=1.0)

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    kafka = kafka.model_copy(update={"claim_check_bytes": 4096})
    ensure_topics(kafka)
    small = [rollout(f"g{i}", 4) for i in range(6)]
    large = rollout("big", 4000)  # claim-checked
    with RolloutPublisher(kafka, BlobStore(kafka.blob_dir)) as pub:
        where = {r.rollout_id: pub.publish(r).result(timeout=30) for r in [*small, large]}
    assert where[large.rollout_id].claim_check
    at = {rid: {d.partition: d.offset} for rid, d in where.items()}
    ends = {p: max(d.offset + 1 for d in where.values() if d.partition == p) for p in (0, 1)}
    wanted = {small[1].rollout_id: at[small[1].rollout_id], large.rollout_id: at[large.rollout_id],
              "never-sent": ends}
    assert published(kafka, wanted, deadline_s=30) == {small[1].rollout_id, large.rollout_id}
    first = where[small[0].rollout_id]  # the read starts at the bounds: what lies before is not read
    assert published(kafka, {small[0].rollout_id: {first.partition: first.offset + 1}}, deadline_s=30) == set()
    assert published(kafka, {small[0].rollout_id: {first.partition: first.offset}}, deadline_s=30) == {
        small[0].rollout_id}
