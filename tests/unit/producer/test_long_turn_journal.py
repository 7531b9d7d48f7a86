"""producer.journal.every_tokens: a long turn journaled while it generates (its tokens so far
in the entry as `Snapshot.partial`), rebuilt, and continued by the resuming runner as the same
turn. A token-by-token stand-in engine; tests/integration/test_journal_long_turns.py runs the
crash on the real vLLM engine and broker."""
from __future__ import annotations

import numpy as np
import pytest

from rlstream.common.config import EpisodeSettings, JournalSettings
from rlstream.common.tasks.envs.calculator import CalculatorEnv
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.journal import EpisodeJournal, Resumer
from rlstream.producer.journal.resume import rebuild
from rlstream.producer.journal.snapshot import JournalError, decode, encode
from rlstream.common.tasks.environment import StepResult
from rlstream.producer.rollout.episodes import EpisodeRunner
from rlstream.producer.sample import FinishedSample, SamplingConfig
from tests.support.scripted import TextCodec, task
from tests.support.journal_memory import MemoryTopic, lease, snapshot

L, K, E = 2, 2, 8


class Streaming(TextCodec):
    """Each step makes one more token of every running turn (the episode's scripted ids, then
    `stop`, or `length` at max_tokens), with RolloutEngine's mid-turn view (`generated`,
    `partial`). Log-prob of token i: -(i + 1) / 100; routing row at position p: p % E."""

    partial_routing = True

    def __init__(self, script: dict[int, list]):  # sample idx -> a turn's ids, or a list of them per turn
        self.script, self.version, self.requests = script, 0, {}
        self.settings = type("S", (), {"max_model_len": 256, "parse_special_tokens": False})()

    def submit_group(self, ids, n, sampling, tag):
        assert n == 1 and sampling.max_tokens >= 1
        self.requests[tag] = {"prompt": np.asarray(ids, np.int32), "max": sampling.max_tokens, "made": 0}

    def has_work(self):
        return bool(self.requests)

    def generated(self, tag):
        return self.requests[tag]["made"] if tag in self.requests else 0

    def partial(self, tag):
        return self._sample(tag, "partial") if tag in self.requests else None

    def step(self):
        out = []
        for tag, r in list(self.requests.items()):
            ids = self._ids(tag)
            r["made"] += 1
            if r["made"] >= min(len(ids), r["max"]):
                out.append(self._sample(tag, "stop" if r["made"] == len(ids) else "length"))
                del self.requests[tag]
        return out

    def _ids(self, tag):
        ids = self.script[int(tag.split("#")[1])]
        return ids[int(tag.split("#t")[1])] if isinstance(ids[0], list) else ids

    def _sample(self, tag, finish):
        r = self.requests[tag]
        made, prompt = r["made"], r["prompt"]
        resp = np.asarray(self._ids(tag)[:made], np.int32)
        rows = np.arange(prompt.size + made - 1) % E
        return FinishedSample(
            tag=tag, sample_idx=0, group_size=1, request_id=f"{tag}/0", prompt_ids=prompt, response_ids=resp,
            logprobs=-(np.arange(made, dtype=np.float32) + 1) / 100, finish_reason=finish, stop_reason=None,
            dispatch_version=0, token_versions=[(self.version, made)],
            routed_experts=np.repeat(rows[:, None, None], L, 1).repeat(K, 2).astype(np.uint8), num_experts=E,
            logprobs_mode="processed_logprobs", submitted_at=0.0, finished_at=0.0)


class Topic(MemoryTopic):
    """`writes` as they were when written (decoded from their bytes), as a reader sees them."""

    def put(self, s):
        super().put(s)
        self.writes[-1] = decode(encode(s))


class Seen:
    """One model turn ends the episode; every turn it is given is kept (resumable: replays)."""

    stop_texts = ()
    resumable = True
    turns: list[tuple[int, ...]] = []

    def reset(self, task):
        return task.prompt

    def step(self, turn):
        Seen.turns.append(turn.token_ids)
        return StepResult(None, 1.0, True, {"seen_tokens": len(turn.token_ids)})


class TwoTurns(Seen):
    """An observation after the first turn, done after the second."""

    def step(self, turn):
        Seen.turns.append(turn.token_ids)
        return StepResult(None if len(Seen.turns) >= 2 else "=1,", 1.0, len(Seen.turns) >= 2)


def producer(topic, pid, script, every, clock=lambda: 0.0, env=Seen):
    eng = Streaming(script)
    settings = EpisodeSettings(max_turns=2, max_turn_tokens=16, max_episode_tokens=64, step_timeout_s=2.0)
    runner = EpisodeRunner(eng, settings, SamplingConfig(max_tokens=16), env)
    runner.journal = EpisodeJournal(topic, pid, JournalSettings(lease_s=10, every_tokens=every), clock=clock)
    return eng, runner


def step_until(eng, runner, pred, n=200):
    ended = []
    for _ in range(n):
        if pred():
            return ended
        ended += runner.advance(eng.step() if eng.has_work() else [], wait_s=0.05)
    raise AssertionError("condition not reached")


# ---------------------------------------------------------------- format

def test_an_entry_with_a_partial_turn_round_trips_and_a_bad_one_is_refused():
    mask = np.array([True] * 5 + [False] * 4 + [True] * 3)
    back = decode(encode(snapshot(mask=mask, partial=3)))
    assert back.partial == 3 and back.mask.tolist() == mask.tolist()
    assert decode(encode(snapshot())).partial == 0  # between turns, as before
    with pytest.raises(JournalError, match="partial turn"):
        decode(encode(snapshot(mask=mask, partial=4)))  # reaches into an observation
    with pytest.raises(JournalError, match="partial turn"):
        decode(encode(snapshot(mask=np.ones(12, bool), partial=13)))


def test_rebuild_keeps_the_partial_turn_out_of_the_turns_and_the_replay():
    mask = np.array([True] * 5 + [False] * 4 + [True] * 3)
    s = decode(encode(snapshot(mask=mask, partial=3)))  # turn 1 done ("c(37+48)"), turn 2 3 tokens in
    env = CalculatorEnv()
    ep = rebuild(s, env, task())
    assert (ep.turns, ep.partial_turn, ep.num_tokens) == (1, 3, 12)
    assert env.calls == 1  # the environment replayed the finished turn only
    assert ep.response_ids.tolist() == s.response.tolist() and ep.loss_mask.tolist() == mask.tolist()
    assert ep.logprobs.tolist() == s.logprobs.tolist() and ep.routing.shape == s.routing.shape


# ------------------------------------------------------------ the runner

def test_a_long_turn_is_journaled_every_n_tokens_with_its_tokens_so_far():
    topic, turn = Topic(), list(range(40, 50))
    eng, runner = producer(topic, "a", {0: turn}, every=4)
    Seen.turns = []
    runner.start("g", 0, 1, task())
    ended = step_until(eng, runner, lambda: not runner.has_work())
    assert [e.end for e in ended] == ["done"] and Seen.turns == [tuple(turn)]
    mid = [w for w in topic.writes if w.partial]
    assert [w.partial for w in mid] == [4, 8]  # one write per 4 tokens, not one per step
    for w in mid:
        k, prompt = w.partial, w.prompt_ids.size
        assert w.turns == 0 and w.model_turns == [] and w.response.tolist() == turn[:k]
        assert w.logprobs.tolist() == (-(np.arange(k, dtype=np.float32) + 1) / 100).tolist()
        assert w.versions.tolist() == [0] * k and w.routing.shape == (prompt + k - 1, L, K)
        assert w.routing[:, 0, 0].tolist() == (np.arange(prompt + k - 1) % E).tolist()


def test_without_every_tokens_a_turn_is_journaled_only_before_it_starts():
    topic = Topic()
    eng, runner = producer(topic, "a", {0: list(range(40, 50))}, every=None)
    runner.start("g", 0, 1, task())
    step_until(eng, runner, lambda: not runner.has_work())
    assert [w.partial for w in topic.writes] == [0]


def test_a_resumed_partial_turn_continues_as_the_same_turn():
    topic, now = Topic(), [0.0]
    eng_a, runner_a = producer(topic, "a", {0: list(range(40, 52))}, every=5, clock=lambda: now[0])
    lease(topic, "a", runner_a.journal.incarnation, 0.0)
    Seen.turns = []
    runner_a.start("g", 0, 1, task())
    step_until(eng_a, runner_a, lambda: eng_a.generated("g#0#t0") == 7)  # written at 5; a dies at 7
    (last,) = [w for w in topic.writes if w.partial]
    assert last.partial == 5 and Seen.turns == []

    now[0] = 11.0  # b starts after a's lease lapsed; its engine samples another ending
    eng_b, runner_b = producer(topic, "b", {0: [60, 61, 62, 63]}, every=5, clock=lambda: now[0])
    lease(topic, "b", runner_b.journal.incarnation, 11.0)
    resumer = Resumer(runner_b.journal, runner_b, InFlightGroups("b"), Seen, lambda text, answer: (1.0, {}))
    assert resumer.tick(trainer_version=0, max_staleness=4) == 1
    (request,) = eng_b.requests.values()
    assert request["prompt"].tolist() == last.prompt_ids.tolist() + list(range(40, 45))  # prefilled
    assert request["max"] == 16 - 5  # the rest of the turn's budget
    ended = step_until(eng_b, runner_b, lambda: not runner_b.has_work())
    (ep,) = ended
    whole = list(range(40, 45)) + [60, 61, 62, 63]
    assert ep.response_ids.tolist() == whole and ep.turns == 1 and ep.end == "done"
    assert ep.logprobs[:5].tolist() == last.logprobs.tolist() and ep.partial_turn == 0
    assert Seen.turns == [tuple(whole)]  # the environment saw the turn once, whole
    assert ep.routing.shape == (last.prompt_ids.size + len(whole) - 1, L, K)
    assert ep.to_rollout("b", runner_b.sampling).reward_info["turns"] == 1


def test_a_later_turn_journaled_mid_way_keeps_only_the_finished_turns_in_the_replay_log():
    topic, first, second = Topic(), [40, 41, 42, 43], list(range(50, 62))
    eng, runner = producer(topic, "a", {0: [first, second]}, every=5, env=TwoTurns)
    Seen.turns = []
    runner.start("g", 0, 1, task())
    ended = step_until(eng, runner, lambda: not runner.has_work())
    assert [e.turns for e in ended] == [2] and Seen.turns == [tuple(first), tuple(second)]
    mid = [w for w in topic.writes if w.partial]
    assert [w.partial for w in mid] == [5, 10]  # the 4-token first turn: none
    for w in mid:
        assert w.turns == 1 and [t.token_ids for t in w.model_turns] == [first]  # the replay: turn 1 only
        assert w.response[:4].tolist() == first and w.response[-w.partial:].tolist() == second[:w.partial]
        assert not w.mask[4:-w.partial].any() and w.mask[-w.partial:].all()  # the observation, then turn 2


def test_with_native_routing_a_turn_is_journaled_between_turns_only(caplog):
    topic = Topic()
    eng, runner = producer(topic, "a", {0: list(range(40, 50))}, every=2)
    eng.partial_routing = False  # vLLM's native routing: rows only when the request ends
    runner.start("g", 0, 1, task())
    step_until(eng, runner, lambda: not runner.has_work())
    assert [w.partial for w in topic.writes] == [0] and "off with routing native" in caplog.text
