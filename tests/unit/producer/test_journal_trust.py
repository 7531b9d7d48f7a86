"""producer/journal/: what a journal reader trusts and how every claim settles (the journal
topic in memory, the scripted engine). tests/integration/test_journal_hostile.py feeds hostile
records through the broker to a running producer; test_journal_fencing.py cuts a producer off."""
from __future__ import annotations

import dataclasses

import numpy as np

from rlstream.common import metrics
from rlstream.common.config import JournalSettings
from rlstream.common.record import Rollout
from rlstream.producer.groups import GroupInfo
from rlstream.producer.journal import EpisodeJournal
from rlstream.producer.journal.claims import Held
from rlstream.producer.journal.snapshot import encode
from rlstream.producer.rollout.trajectory import Trajectory
from tests.support.scripted import AbortingEngine, run
from tests.support.journal_memory import Ack, LaggingTopic, MemoryTopic, lease, producer, snapshot
from tests.support.scripted import task

LEASE, SKEW = 10.0, JournalSettings().max_clock_skew_s


def count(name: str, **labels) -> float:
    return metrics.value(name, **labels) or 0


# ------------------------------------------------------------ time is judged

def test_a_claim_dated_in_the_future_does_not_take_a_live_episode():
    now = [1000.0]
    topic = MemoryTopic(clock=lambda: now[0])
    lease(topic, "a", "live", 999.0)  # a renewed a second ago
    live = snapshot(group_id="g", sample_idx=0, holder="a", incarnation="live", written_at=999.5)
    topic._fold(live.key, encode(live))
    future0 = count("rlstream_producer_journal_future_times_total")
    token = Held(live.key, "a", "live", 999.5).token
    for at in (now[0] + 100, now[0]):  # a forged claim dated 100 s ahead, and the same dated now
        topic._fold(live.key, encode(dataclasses.replace(live, holder="z", incarnation="zz", written_at=at,
                                                         claimed_from=token, epoch=1)))
        held = topic.entries[live.key]
        assert (held.holder, held.incarnation, held.epoch) == ("a", "live", 0)
    assert count("rlstream_producer_journal_future_times_total") - future0 == 1


def test_a_lease_dated_an_hour_ahead_does_not_keep_a_dead_producers_episodes_from_being_resumed():
    now = [1000.0]
    topic = MemoryTopic(clock=lambda: now[0])
    lease(topic, "k", "killed", 900.0)
    orphans = [snapshot(group_id="g", sample_idx=i, group_size=40, holder="k", incarnation="killed",
                        written_at=900.0) for i in range(40)]
    for s in orphans:
        topic._fold(s.key, encode(s))
    lease(topic, "ghost", "none", now[0] + 3600)  # a producer that does not exist
    b = EpisodeJournal(topic, "b", JournalSettings(lease_s=LEASE), clock=lambda: now[0])
    lease(topic, "b", b.incarnation, now[0])
    first = {s.key for s in b.claim()}
    assert 0 < len(first) < 40  # the ghost looks alive for now (its lease judged at now + skew)
    now[0] += LEASE + SKEW + 1  # ... and no longer than lease_s past that
    lease(topic, "b", b.incarnation, now[0])
    assert first | {s.key for s in b.claim()} == {s.key for s in orphans}


# ------------------------------------------------------- claims that settle

def trajectory(sample_idx: int = 0) -> Trajectory:
    return Trajectory("g", sample_idx, 2, task=task(), prompt_ids=np.arange(1, 6, dtype=np.int32))


def test_a_producer_never_claims_its_own_finished_episode():
    topic, now = LaggingTopic(), [100.0]
    j = EpisodeJournal(topic, "b", JournalSettings(lease_s=LEASE), clock=lambda: now[0])
    lease(topic, "b", j.incarnation, now[0])
    j.on_turn(trajectory())  # its entry is written, not yet read back
    record = Rollout(rollout_id="x", group_id="g", sample_idx=0, group_size=2, prompt_ids=np.arange(1, 6, dtype=np.int32),
                     response_ids=np.ones(2, np.int32), logprobs=np.zeros(2, np.float32), policy_version=0, reward=0.0)
    rid = j.stamp(record).rollout_id
    j.on_delivered(Ack(rid))
    lost0 = count("rlstream_producer_resumed_episodes_total", outcome="claimed_by_peer")
    for step in range(6):  # the reader catches up one write at a time, a claim pass in between
        now[0] += LEASE / 4
        lease(topic, "b", j.incarnation, now[0])
        assert j.claim() == [] and j.confirmed() == []
        if topic.queue:
            topic._fold(*topic.queue.pop(0))
    assert len(topic.writes) == 1 and not topic.queue and topic.entries == {}  # the entry, then its tombstone
    assert count("rlstream_producer_resumed_episodes_total", outcome="claimed_by_peer") == lost0


def test_an_entry_under_the_wrong_key_is_refused_once_not_claimed_forever():
    topic, now = MemoryTopic(), [100.0]
    wrong = encode(snapshot(group_id="g", sample_idx=1, holder="dead", incarnation="x", written_at=10.0))
    refused0 = count("rlstream_producer_journal_refused_total", reason="key_mismatch")
    topic._fold("ep:g#0", wrong)
    b = EpisodeJournal(topic, "b", JournalSettings(lease_s=LEASE), clock=lambda: now[0])
    for _ in range(20):
        now[0] += LEASE / 4
        lease(topic, "b", b.incarnation, now[0])
        assert b.take(b.claim()) == []
    assert topic.writes == [] and topic.entries == {}
    assert count("rlstream_producer_journal_refused_total", reason="key_mismatch") - refused0 == 1
    assert [letter.reason for letter in topic.sent] == ["key_mismatch"]  # b would claim it: b copies it to the DLQ


def test_a_producer_whose_lease_lapsed_stops_the_episodes_a_peer_took_over_and_publishes_none():
    """a is cut off (its lease stops reaching the journal) with two episodes between turns; b
    claims and resumes them. When a reads the journal again, one episode is still running
    there (abandoned) and one has just ended (its record not published): both counted, with
    the generation time a spent after the state b resumed from; b's records carry epoch 1."""
    topic, now = MemoryTopic(), [0.0]
    script = {0: ["c(37+48)", "c(85-19)", "c(1+1)", "66$"], 1: ["c(1+1)", "c(2+2)", "7$"]}
    eng, runner, a, groups, resumer = producer(topic, "a", script, lambda: now[0])
    eng = runner.engine = AbortingEngine(script)
    lease(topic, "a", a.incarnation, 0.0)
    groups.add("g", GroupInfo(task(), 2))
    for i in range(2):
        runner.start("g", i, 2, task())
    for _ in range(100):  # both between turns 1 and 2
        if sorted(eng.requests) == ["g#0#t1", "g#1#t1"]:
            break
        runner.advance(eng.step() if len([t for t in eng.requests if t.endswith("#t0")]) == 2 else [], wait_s=0.05)
    now[0] = 11.0  # a's lease lapsed in the journal (a still runs: cut off)
    eng_b, runner_b, b, groups_b, resumer_b = producer(topic, "b", script, lambda: now[0])
    lease(topic, "b", b.incarnation, 11.0)
    assert resumer_b.tick(trainer_version=0, max_staleness=1) == 2
    ended_b = run(eng_b, runner_b)
    stamped = [b.stamp(e.to_rollout("b", runner_b.sampling, "37+48-19=")) for e in ended_b]
    assert sorted(r.claim_epoch for r in stamped) == [1, 1]
    # a, meanwhile: one turn more for both, then episode 1 ends; then a reads the journal again
    fenced0 = {at: count("rlstream_producer_episodes_fenced_total", at=at) for at in ("running", "ended")}
    wasted0 = count("rlstream_producer_fenced_generation_seconds_total")
    runner.advance(eng.step(), wait_s=0.05)
    ended = []
    for _ in range(50):
        ended += runner.advance(eng.step() if "g#1#t2" in eng.requests else [], wait_s=0.05)
        if ended:
            break
    assert [e.sample_idx for e in ended] == [1] and runner.active == 1
    now[0] = 20.0
    resumer.tick(trainer_version=0, max_staleness=1)  # a's claim pass: b holds both now
    assert runner.active == 0 and not eng.requests  # episode 0 abandoned
    groups.finish_sample("g")  # (the driver does, before it stamps the record)
    assert a.stamp(ended[0].to_rollout("a", runner.sampling, "37+48-19=")) is None  # not published
    assert {at: count("rlstream_producer_episodes_fenced_total", at=at) - fenced0[at] for at in fenced0} ==\
        {"running": 1, "ended": 1}
    assert count("rlstream_producer_fenced_generation_seconds_total") - wasted0 > 2 * 9.0  # since a's last writes
    assert len(groups) == 0  # the group's slots are free
    assert all(e.holder == "b" for e in topic.entries.values())  # a tombstoned nothing of b's
