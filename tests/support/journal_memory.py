"""The producer's journal without a broker (the journal's unit tests): entries, the topic's
fold in memory, leases, and a producer's episode runner with its journal and resumer over
the scripted engine.

    snapshot      a valid journal entry (every field set; keyword arguments replace fields)
    MemoryTopic   the journal topic's fold in memory: every write is read back at once
    LaggingTopic  a MemoryTopic whose own writes are read back only on catch_up()
    Ack           a publisher acknowledgement that succeeded
    lease         a producer's lease written into a topic at a given time
    producer      (engine, runner, journal, groups, resumer) of one producer on a topic
"""
from __future__ import annotations

import json

import numpy as np

from rlstream.common.config import JournalSettings
from rlstream.common.tasks.envs.calculator import CalculatorEnv
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.journal import EpisodeJournal, Resumer
from rlstream.producer.journal.snapshot import ModelTurnLog, Snapshot, encode
from rlstream.producer.journal.topic import JournalTopic
from rlstream.producer.rollout.episodes import EpisodeRunner
from rlstream.producer.sample import SamplingConfig
from tests.support.scripted import ScriptedEngine, settings


def snapshot(**kw) -> Snapshot:
    rng = np.random.default_rng(0)
    base = dict(group_id="p-1-7", sample_idx=2, group_size=4, owner="p", holder="p", incarnation="i1",
                rollout_id="r" * 32, written_at=100.0, prompt_text="37+48-19=", answer="66", own_score=False,
                prompt_ids=np.arange(9, dtype=np.int32), response=np.arange(12, dtype=np.int32),
                mask=np.array([True] * 8 + [False] * 4),
                logprobs=np.concatenate([-rng.random(8), np.zeros(4)]).astype(np.float32),
                versions=np.array([3] * 8 + [4] * 4, dtype=np.int64),
                routing=rng.integers(0, 8, (20, 2, 2)).astype(np.uint8), num_experts=8, turns=1, reward=0.0,
                info={"tool_calls": 1, "nested": {"dropped": True}},
                model_turns=[ModelTurnLog("c(37+48)", [5, 6, 7], "stop")])
    return Snapshot(**{**base, **kw})


class MemoryTopic(JournalTopic):
    """The journal topic's fold without a broker: every write is read back at once."""

    def __init__(self, clock=lambda: float("inf")):
        self.init_view(10.0, clock=clock)  # by default every time is in the reader's past (trusted as written)
        self.topic = "journal"
        self.writes, self.sent = [], []

    def put(self, s):
        self.writes.append(s)
        self._fold(s.key, encode(s))

    def read_past(self, writes, timeout_s=30.0):
        pass  # read back at once

    def tombstone(self, key):
        self._fold(key, None)

    def renew_lease(self, producer_id, incarnation):
        self._fold(f"lease:{producer_id}", json.dumps({"incarnation": incarnation, "at": 0.0}).encode())

    def flush(self, timeout_s=10.0):
        pass

    def send_letters(self, letters):
        self.sent += letters

    def poll(self, timeout_ms=0, until_end=False):
        pass

    def close(self):
        pass


class Ack:
    def __init__(self, rollout_id):
        self.rollout_id = rollout_id

    def cancelled(self):
        return False

    def exception(self):
        return None


def lease(topic, pid, incarnation, at):
    topic._fold(f"lease:{pid}", json.dumps({"incarnation": incarnation, "at": at}).encode())


def producer(topic, pid, script, clock):
    eng = ScriptedEngine(script)
    runner = EpisodeRunner(eng, settings(), SamplingConfig(max_tokens=16), CalculatorEnv)
    journal = EpisodeJournal(topic, pid, JournalSettings(lease_s=10), clock=clock)
    runner.journal = journal
    groups = InFlightGroups(pid)
    resumer = Resumer(journal, runner, groups, CalculatorEnv, lambda text, answer: (float(text.strip() == answer), {}))
    return eng, runner, journal, groups, resumer


class LaggingTopic(MemoryTopic):
    """Own writes are read back only on `catch_up()` (a consumer behind its producer)."""

    def __init__(self):
        super().__init__()
        self.queue = []

    def put(self, s):
        self.writes.append(s)
        self.queue.append((s.key, encode(s)))

    def tombstone(self, key):
        self.queue.append((key, None))

    def catch_up(self):
        for key, value in self.queue:
            self._fold(key, value)
        self.queue.clear()
