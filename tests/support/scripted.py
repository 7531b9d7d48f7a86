"""Scripted stand-ins for RolloutEngine (producer/engine.py) in the unit tests of the episode
and agent drivers: each submitted turn finishes at the next step() with a scripted text, over
the tiny model's tokenizer; no vLLM.

    ScriptedEngine       episodes (producer/rollout/episodes.py): turn t of episode i answers
                         script[i][t] ("$" at the end: <eos>); a reload mid-turn splits the
                         turn's token versions
    AbortingEngine       a ScriptedEngine that can abort a turn (abort_tag)
    ScriptedAgentEngine  the agent endpoint (producer/rollout/agents/): the replies, in order
    TextCodec            the text side of every stand-in (encode, decode, tokenizer)
    task, settings, run  a calculator task, episode limits, stepping until the episodes end
"""
from __future__ import annotations

import numpy as np

from rlstream.common.config import EpisodeSettings
from rlstream.common.tasks.task import Task
from rlstream.producer.rollout.agents.driver import AgentTag
from rlstream.producer.sample import FinishedSample
from rlstream.toy.tinymodel import build_tokenizer

TOK = build_tokenizer()
L, K, E = 2, 2, 8
"""The tiny model's routing: layers, experts per token, experts."""


class TextCodec:
    """A stand-in engine's text side: the tiny model's tokenizer."""

    def encode(self, text):
        return np.asarray(TOK.encode(text, add_special_tokens=False), dtype=np.int32)

    def decode(self, ids):
        return TOK.decode([int(i) for i in ids], skip_special_tokens=True)

    def tokenizer(self):
        return TOK


def finished_turn(tag, ids, resp, logprobs, dispatch, token_versions, routing) -> FinishedSample:
    """A finished single-sample request, as RolloutEngine.step reports it."""
    return FinishedSample(
        tag=tag, sample_idx=0, group_size=1, request_id=f"{tag}/0", prompt_ids=ids, response_ids=resp,
        logprobs=logprobs, finish_reason="stop", stop_reason=None, dispatch_version=dispatch,
        token_versions=token_versions, routed_experts=routing, num_experts=E, logprobs_mode="processed_logprobs",
        submitted_at=0.0, finished_at=0.0)


class _StandIn(TextCodec):
    """What the scripted stand-ins share: RolloutEngine's settings, the version it serves, the
    requests in flight by tag (prompt ids, sampling, version at dispatch), and a step that
    finishes every one of them (`_finish`)."""

    def __init__(self, max_model_len: int):
        self.version, self.requests = 0, {}
        self.settings = type("S", (), {"max_model_len": max_model_len, "parse_special_tokens": False})()

    def has_work(self):
        return bool(self.requests)

    def step(self):
        out = []
        for tag, (ids, sampling, dispatch) in list(self.requests.items()):
            out.append(self._finish(tag, ids, sampling, dispatch))
            del self.requests[tag]
        return out

    def _finish(self, tag, ids, sampling, dispatch) -> FinishedSample:
        raise NotImplementedError


class ScriptedEngine(_StandIn):
    """Pure-logic stand-in for RolloutEngine: each submitted turn finishes at the next
    step() with the scripted text of its episode's turn; routing row i = position i."""

    def __init__(self, script: dict[int, list[str]], max_model_len: int = 256):
        super().__init__(max_model_len)
        self.script = script
        self.prompts: list[np.ndarray] = []

    def submit_group(self, ids, n, sampling, tag):
        assert n == 1 and sampling.max_tokens >= 1
        self.requests[tag] = (np.asarray(ids), sampling, self.version)
        self.prompts.append(np.asarray(ids))

    def _finish(self, tag, ids, sampling, dispatch):
        idx, turn = int(tag.split("#")[1]), int(tag.split("#t")[1])
        text = self.script[idx][turn]
        resp = self.encode(text.replace("$", ""))
        if text.endswith("$"):
            resp = np.r_[resp, 1].astype(np.int32)  # <eos>
        resp = resp[:sampling.max_tokens]
        pos = np.arange(ids.size + resp.size - 1)  # expert 0: the turn that computed the row (< 3)
        routing = np.stack([np.full(pos.size, turn), 3 + pos % 5], -1)[:, None, :].repeat(L, 1).astype(np.uint8)
        half = resp.size // 2  # a reload "mid-turn" when the engine's version moved
        versions = [(dispatch, resp.size)] if self.version == dispatch else\
            [(dispatch, half), (self.version, resp.size - half)]
        return finished_turn(tag, ids, resp, np.full(resp.size, -0.25, np.float32), dispatch,
                             [v for v in versions if v[1]], routing)


class AbortingEngine(ScriptedEngine):
    """A ScriptedEngine whose turns can be aborted, as RolloutEngine.abort_tag does."""

    def abort_tag(self, tag):
        return int(self.requests.pop(tag, None) is not None)


class ScriptedAgentEngine(_StandIn):
    """Stand-in RolloutEngine for the agent endpoint: each submitted turn finishes at the next
    step() with the next scripted text; routing row i = (turn, position i)."""

    def __init__(self, replies: list[str], max_model_len: int = 256):
        super().__init__(max_model_len)
        self.replies = list(replies)
        self.model_dir = type("P", (), {"name": "tiny"})()

    def submit_group(self, ids, n, sampling, tag):
        assert n == 1 and isinstance(tag, AgentTag) and ids.size + sampling.max_tokens <= self.settings.max_model_len
        self.requests[tag] = (np.asarray(ids), sampling, self.version)

    def _finish(self, tag, ids, sampling, version):
        resp = self.encode(self.replies.pop(0))[:sampling.max_tokens]
        rows = np.stack([np.full(ids.size + resp.size - 1, tag.turn), np.arange(ids.size + resp.size - 1) % 8],
                        -1)[:, None, :].repeat(L, 1).astype(np.uint8)
        return finished_turn(tag, ids, resp, np.linspace(-0.1, -1.0, resp.size).astype(np.float32), version,
                             [(version, resp.size)], rows)


def task(prompt="37+48-19=", answer="66"):
    return Task(prompt, answer, lambda text: (float(text.strip() == answer), {"correct": text.strip() == answer}))


def run(engine, runner, n_steps=50):
    """Step `engine` and advance `runner` until its episodes end (at most `n_steps`); the ended ones."""
    ended = []
    for _ in range(n_steps):
        ended += runner.advance(engine.step() if engine.has_work() else [], wait_s=0.05)
        if not runner.has_work():
            break
    return ended


def settings(**kw):
    """Episode limits for the scripted runs (`kw` overrides)."""
    return EpisodeSettings(**{"max_turns": 4, "max_turn_tokens": 16, "max_episode_tokens": 64,
                              "step_timeout_s": 2.0, **kw})
