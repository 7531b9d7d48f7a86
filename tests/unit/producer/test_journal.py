"""producer/journal/: the entry format, the claim rule, and a crash between two runners
(scripted engine, calculator environment, the journal topic in memory);
tests/integration/test_episode_journal.py runs the crash on the real engine and broker."""
from __future__ import annotations


import numpy as np
import pytest

from rlstream.common.config import JournalSettings
from rlstream.common.record import Rollout
from rlstream.common.tasks.envs.calculator import CalculatorEnv
from rlstream.producer.journal import EpisodeJournal, StalenessView
from rlstream.producer.journal.claims import Held, Lease, claimant, claims_for, is_orphan
from rlstream.producer.journal.snapshot import JournalError, decode, encode
from tests.support.journal_memory import Ack, LaggingTopic, MemoryTopic, lease, producer, snapshot
from tests.support.scripted import run, task


# ---------------------------------------------------------------- format

def test_an_entry_round_trips_every_array_and_field():
    s = snapshot()
    back = decode(encode(s))
    for name in ("prompt_ids", "response", "mask", "logprobs", "versions", "routing"):
        a, b = getattr(s, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert back.model_turns == s.model_turns and back.key == "ep:p-1-7#2" and back.oldest_version == 3
    assert back.info == {"tool_calls": 1}  # only what a record's reward_info can carry
    assert decode(encode(snapshot(routing=None))).routing is None


def test_a_malformed_entry_is_a_journal_error_not_a_crash():
    good = encode(snapshot())
    with pytest.raises(JournalError, match="magic"):
        decode(b"junk")
    with pytest.raises(JournalError, match="past the entry's end"):
        decode(good[:-10])
    with pytest.raises(JournalError, match="must agree"):
        decode(encode(snapshot(mask=np.ones(11, dtype=bool))))
    with pytest.raises(JournalError, match="malformed"):
        decode(good[:3] + good[3:7] + b"{" * (len(good) - 7))


# ----------------------------------------------------------------- claims

def test_an_entry_is_orphaned_when_its_lease_lapses_or_its_producer_restarted():
    e = Held("ep:g#0", "a", "inc1", written_at=0.0)
    assert not is_orphan(e, {"a": Lease("a", "inc1", 95.0)}, now=100.0, lease_s=10)
    assert is_orphan(e, {"a": Lease("a", "inc1", 85.0)}, now=100.0, lease_s=10)  # lapsed
    assert is_orphan(e, {"a": Lease("a", "inc2", 99.0)}, now=100.0, lease_s=10)  # restarted: at once
    assert is_orphan(e, {}, now=100.0, lease_s=10) and not is_orphan(e, {}, now=5.0, lease_s=10)


def test_each_orphan_goes_to_exactly_one_live_producer():
    leases = {"a": Lease("a", "x", 0.0), "b": Lease("b", "y", 99.0), "c": Lease("c", "z", 99.0)}
    entries = [Held(f"ep:g#{i}", "a", "x", 0.0) for i in range(40)] + [Held("ep:h#0", "b", "y", 99.0)]
    got_b = claims_for("b", entries, leases, now=100.0, lease_s=10)
    got_c = claims_for("c", entries, leases, now=100.0, lease_s=10)
    assert sorted(got_b + got_c) == sorted(e.key for e in entries[:40])  # all of a's; none of b's live one
    assert got_b and got_c and not set(got_b) & set(got_c)  # spread over both, never twice
    assert claims_for("a", entries, leases, now=100.0, lease_s=10) == []  # a dead producer claims nothing
    assert claimant("ep:g#0", []) is None


# ------------------------------------------------------- crash and resume

def test_a_crashed_producers_episode_is_resumed_by_a_peer_from_its_last_turn():
    topic, now = MemoryTopic(), [0.0]
    script = {0: ["c(37+48)", "c(85-19)", "66$"], 1: ["c(1+1)", "7$"]}
    eng, runner, journal, _, _ = producer(topic, "a", script, lambda: now[0])
    lease(topic, "a", journal.incarnation, 0.0)
    for i in range(2):
        runner.start("g", i, 2, task())
    for _ in range(100):  # until turn 1 of both is done and their turn 2 submitted (journaled)
        if sorted(eng.requests) == ["g#0#t1", "g#1#t1"]:
            break
        first = [t for t in eng.requests if t.endswith("#t0")]
        runner.advance(eng.step() if len(first) == 2 else [], wait_s=0.05)
    assert sorted(eng.requests) == ["g#0#t1", "g#1#t1"]
    before = {s.sample_idx: s for s in topic.writes if s.turns == 1}
    # producer a dies here (nothing more of it runs); b starts 11 s later, after a's lease lapsed
    now[0] = 11.0
    eng_b, runner_b, journal_b, groups_b, resumer_b = producer(topic, "b", script, lambda: now[0])
    lease(topic, "b", journal_b.incarnation, 11.0)  # b's first lease, read back
    assert resumer_b.tick(trainer_version=0, max_staleness=1) == 2
    assert len(groups_b) == 1
    ended = run(eng_b, runner_b)
    by = {e.sample_idx: e for e in ended}
    assert sorted(by) == [0, 1] and by[0].turns == 3 and by[0].reward == 1.0  # the calculator was replayed
    for i, e in by.items():
        n = before[i].response.size
        assert e.response_ids[:n].tolist() == before[i].response.tolist()
        assert e.logprobs[:n].tolist() == before[i].logprobs.tolist()
        assert e.loss_mask[:n].tolist() == before[i].mask.tolist()
        record = journal_b.stamp(e.to_rollout("b", runner_b.sampling, "37+48-19="))
        assert (record.producer_id, record.rollout_id) == ("a", before[i].rollout_id)  # a's copy, one id
        groups_b.finish_sample("g")
        journal_b.on_delivered(Ack(record.rollout_id))
    now[0] += 5
    journal_b.claim()  # the next pass tombstones what was acknowledged
    assert topic.entries == {} and len(groups_b) == 0


def test_unresumable_and_stale_episodes_are_dropped_and_tombstoned():
    from rlstream.producer import telemetry
    from rlstream.common import metrics

    class Plain(CalculatorEnv):
        resumable = False

    topic = MemoryTopic()
    _, runner, journal, _, resumer = producer(topic, "b", {}, lambda: 0.0)
    resumer.env_factory = Plain
    count = lambda o: metrics.value("rlstream_producer_resumed_episodes_total", outcome=o) or 0  # noqa: E731
    n0, s0 = count("not_resumable"), count("stale")
    assert not resumer.resume(snapshot(), StalenessView(0, 1))
    resumer.env_factory = CalculatorEnv
    assert not resumer.resume(snapshot(versions=np.zeros(12, np.int64)), StalenessView(5, 2))
    assert not resumer.resume(snapshot(own_score=True), StalenessView(0, 1))
    assert (count("not_resumable") - n0, count("stale") - s0) == (2, 1) and runner.active == 0
    assert telemetry.RESUMED is not None


def test_an_episode_finished_here_is_not_claimed_again_from_an_entry_read_back_late():
    topic, now = LaggingTopic(), [200.0]
    topic._fold("ep:g#0", encode(snapshot(group_id="g", sample_idx=0, holder="a", incarnation="dead")))
    journal = EpisodeJournal(topic, "b", JournalSettings(lease_s=10), clock=lambda: now[0])
    lease(topic, "b", journal.incarnation, 200.0)
    (s,) = journal.claim()  # a's lease is absent and its entry old: b resumes it
    journal.adopt(s)  # ... and the episode ends here before b reads its own writes back
    r = Rollout(rollout_id="x", group_id="g", sample_idx=0, group_size=4, prompt_ids=s.prompt_ids,
                response_ids=s.response, logprobs=s.logprobs, policy_version=0, reward=0.0)
    assert journal.stamp(r).rollout_id == s.rollout_id
    now[0] += 5
    assert journal.claim() == []  # a's old entry is still what b sees: not a second resume
    journal.on_delivered(Ack(s.rollout_id))
    now[0] += 5
    assert journal.claim() == []  # this pass tombstones the acknowledged episode's entry
    topic.catch_up()
    now[0] += 5
    assert journal.claim() == [] and journal._ended == {} and topic.entries == {}


def test_a_reader_behind_the_journal_does_not_take_a_live_peer_for_dead():
    topic, now = MemoryTopic(), [1000.0]  # the wall clock is far ahead of what b has read
    lease(topic, "a", "inc-a", 10.0)
    topic._fold("ep:g#0", encode(snapshot(group_id="g", sample_idx=0, holder="a", incarnation="inc-a",
                                          written_at=10.5)))
    journal = EpisodeJournal(topic, "b", JournalSettings(lease_s=10), clock=lambda: now[0])
    lease(topic, "b", journal.incarnation, 11.0)
    assert journal.claim() == []  # a renewed its lease within what b has read
    lease(topic, "b", journal.incarnation, 25.0)  # b reads on: a's lease stopped at 10
    now[0] += 5
    assert [s.key for s in journal.claim()] == ["ep:g#0"]


# ------------------------------------------- one claimant, one publication

def test_of_two_claims_of_one_entry_only_the_first_in_the_log_takes_effect():
    from rlstream.common import metrics

    topic = MemoryTopic()
    orphan = snapshot(group_id="g", sample_idx=0, holder="a", incarnation="dead", written_at=10.0)
    topic._fold(orphan.key, encode(orphan))
    b = EpisodeJournal(topic, "b", JournalSettings(lease_s=10), clock=lambda: 50.0)
    c = EpisodeJournal(topic, "c", JournalSettings(lease_s=10), clock=lambda: 50.0)
    lost0 = metrics.value("rlstream_producer_resumed_episodes_total", outcome="claimed_by_peer") or 0
    # b and c both decided from their own views of the leases that the orphan is theirs
    assert [s.key for s in b.take([decode(encode(orphan))])] == ["ep:g#0"]
    assert c.take([decode(encode(orphan))]) == []  # its claim names a's entry, which b's replaced
    assert (metrics.value("rlstream_producer_resumed_episodes_total", outcome="claimed_by_peer") or 0) - lost0 == 1
    held = topic.entries["ep:g#0"]
    assert (held.holder, held.incarnation) == ("b", b.incarnation)
    assert topic.writes[0].rollout_ends == orphan.rollout_ends  # the claim keeps where a's record could lie
    # a write of a process that no longer holds the entry (a, taken for dead, still running) is ignored
    topic.put(snapshot(group_id="g", sample_idx=0, holder="a", incarnation="dead", written_at=60.0, turns=2))
    assert topic.entries["ep:g#0"].holder == "b"


def test_an_orphan_whose_record_was_published_before_its_holder_died_is_not_resumed():
    from rlstream.common import metrics

    topic, asked = MemoryTopic(), []
    mine = snapshot(group_id="g", sample_idx=0, holder="a", incarnation="dead", rollout_id="done",
                    rollout_ends={0: 7, 1: 3}, written_at=10.0)
    other = snapshot(group_id="g", sample_idx=1, holder="a", incarnation="dead", rollout_id="open", written_at=10.0)
    for s in (mine, other):
        topic._fold(s.key, encode(s))
    _, runner, journal, groups, resumer = producer(topic, "b", {}, lambda: 50.0)
    journal._published = lambda wanted: asked.append(wanted) or {"done"}
    lease(topic, "b", journal.incarnation, 50.0)
    n0 = metrics.value("rlstream_producer_resumed_episodes_total", outcome="published") or 0
    assert resumer.tick(trainer_version=0, max_staleness=4) == 1  # `open` only
    assert asked == [{"done": {0: 7, 1: 3}, "open": {}}]  # looked up from each holder's bounds
    assert (metrics.value("rlstream_producer_resumed_episodes_total", outcome="published") or 0) - n0 == 1
    assert "ep:g#0" not in topic.entries and runner.active == 1  # its entry tombstoned, the other resumed


def test_claims_not_read_back_in_an_outage_are_resumed_at_the_next_claim():
    class Outage(MemoryTopic):
        down = True

        def read_past(self, writes, timeout_s=30.0):
            if self.down:
                raise TimeoutError("broker unreachable")

    topic = Outage()
    orphan = snapshot(group_id="g", sample_idx=0, holder="a", incarnation="dead", written_at=10.0)
    topic._fold(orphan.key, encode(orphan))
    journal = EpisodeJournal(topic, "b", JournalSettings(lease_s=10), clock=lambda: 50.0)
    lease(topic, "b", journal.incarnation, 50.0)
    assert journal.take(journal.claim()) == []  # the claim applied, but b could not know
    assert topic.entries["ep:g#0"].holder == "b"  # ... so no peer will take it: b must
    topic.down = False
    journal._next_claim = 0.0
    assert journal.take(journal.claim()) == []  # not claimed again: it is b's
    assert [s.key for s in journal.confirmed()] == ["ep:g#0"]


def test_a_claim_from_a_view_behind_the_holders_renewal_does_not_take_a_live_episode():
    topic = MemoryTopic()
    lease(topic, "a", "live", 0.0)
    entry = snapshot(group_id="g", sample_idx=0, holder="a", incarnation="live", written_at=1.0)
    topic._fold(entry.key, encode(entry))
    b = EpisodeJournal(topic, "b", JournalSettings(lease_s=10), clock=lambda: 20.0)
    stale_view = decode(encode(entry))  # b judged it orphaned: a's lease at 0 was all b had read
    lease(topic, "a", "live", 19.5)  # ... but a renewed before b's claim reached the journal
    assert b.take([stale_view]) == []
    assert topic.entries["ep:g#0"].holder == "a"  # a keeps its episode; b resumes nothing


def test_an_entry_whose_arrays_do_not_decode_is_skipped_when_claimed_not_a_crash():
    from rlstream.common import metrics

    topic = MemoryTopic()  # readers fold headers only: the arrays are read when an entry is claimed
    torn = encode(snapshot(group_id="g", sample_idx=0, holder="a", incarnation="dead", written_at=10.0))[:-10]
    topic._fold("ep:g#0", torn)
    assert topic.entries["ep:g#0"].holder == "a"
    journal = EpisodeJournal(topic, "b", JournalSettings(lease_s=10), clock=lambda: 50.0)
    lease(topic, "b", journal.incarnation, 50.0)
    bad0 = metrics.value("rlstream_producer_journal_refused_total", reason="entry") or 0
    assert journal.claim() == [] and "ep:g#0" not in topic.entries
    assert (metrics.value("rlstream_producer_journal_refused_total", reason="entry") or 0) - bad0 == 1
