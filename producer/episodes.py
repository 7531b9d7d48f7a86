"""Multi-turn episodes: the environment protocol and the runner that interleaves
many episodes in one engine (docs/multi-turn.md).

An environment (producer/envs/) follows `Environment`:

    observation = env.reset(task)                            # text: the prompt
    result = env.step(ModelTurn(text, token_ids, finish))    # StepResult(observation, reward, done, info)

`EpisodeRunner` drives one episode per sample. Every reset and step runs on a
thread pool (never on the engine's thread) with a deadline
(`producer.episodes.step_timeout_s`); a step that raises or misses its deadline
ends the episode with a reason, counted in `rlstream_producer_episodes_total{end}`
and written to `reward_info["end"]`. The episode is still published (reward so
far) so that its group completes. A timed-out step's thread is abandoned, not
killed: an environment must not block forever.

Token-in, token-out. The model's turn is appended exactly as sampled (ids,
log-probs, per-token versions from the engine); the environment's text is
tokenised once (`ObservationEncoder`: through the chat template where the
tokenizer has one; a special token's text in it stays text, producer/text_tokens.py)
and appended with loss mask 0, log-prob 0 and the engine's
version at that moment. The next model turn is submitted as soon as the step
returns, with the whole token sequence as its prompt, so episodes at different
turns share the engine's continuous batching; nothing is ever decoded and
re-encoded.

Routing: each turn's request computes rows for its whole prompt again (no
prefix cache). Row i of the record is taken from the first request that
computed it (the turn that sampled the token, or for environment positions the
next turn's prefill), so a model token's routing is the one it was sampled
with, also across a weight update between turns.

Limits: `max_turns` model turns, `max_turn_tokens` per turn, and
`max_episode_tokens` response tokens (model and environment) per episode; the
limit that ends an episode names its end reason (`max_turns`, `max_tokens`).
The response always ends with a model turn (an observation that would be the
last thing appended is not appended).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from common.config import EpisodeSettings
from common.errors import ConfigError
from common.record import DEFAULT_LIMITS, Rollout
from producer import telemetry
from producer.sample import FinishedSample, SamplingConfig
from producer.text_tokens import RewrittenSpecialText, encode_rendered, encode_text

END_REASONS = ("done", "max_turns", "max_tokens", "step_timeout", "env_error")
_FINISH = {"done": "stop", "max_turns": "length", "max_tokens": "length",
           "step_timeout": "abort", "env_error": "abort",
           "reported": "stop", "verified": "stop"}  # the last two: black-box agents (producer/agents.py)
"""Episode end -> the record's finish_reason."""


@dataclass(frozen=True)
class EpisodeTask:
    """What an environment is reset with."""

    prompt_text: str
    answer: str
    score: Callable[[str], tuple[float, dict]]
    """The task's reward of a final answer text."""


@dataclass(frozen=True)
class ModelTurn:
    text: str
    """The turn's tokens decoded (special tokens skipped): what the environment parses."""
    token_ids: tuple[int, ...]
    finish_reason: str
    """The engine's: "stop" (a stop token or EOS, included in token_ids) or "length"."""


@dataclass(frozen=True)
class StepResult:
    observation: str | None
    """Text appended before the next model turn; None (or done) ends the episode."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    stop_texts: tuple[str, ...]
    """Texts that end a model turn (each one token of the model's vocabulary), besides EOS."""
    # Optional `resumable = True`: reset(task) then step() with the episode's model turns, in
    # order, rebuilds the environment's state (a journaled episode resumes: producer/journal/).

    def reset(self, task: EpisodeTask) -> str: ...

    def step(self, turn: ModelTurn) -> StepResult: ...


class ObservationEncoder:
    """Environment text -> token ids, once. Without a chat template: the plain
    tokenizer. With one: the text as a message of `role`, rendered as the
    template renders it after an assistant turn, minus the model's own closing
    token (it is already in the response, as sampled). Either way a special
    token's text in the messages is ordinary text unless `parse_special`
    (producer.engine.parse_special_tokens)."""

    def __init__(self, tokenizer, role: str = "tool", parse_special: bool = False):
        self.tok, self.role, self.parse_special = tokenizer, role, parse_special
        self.template = getattr(tokenizer, "chat_template", None) is not None

    def __call__(self, text: str, last_model_token: int | None = None) -> list[int]:
        return self.messages([{"role": self.role, "content": text}], last_model_token)

    def messages(self, messages: list[dict], last_model_token: int | None = None) -> list[int]:
        """Messages that follow a model turn (tool, user or system), as token ids; without
        a chat template their contents concatenated (producer/agents.py uses this too)."""
        if not self.template:
            return encode_text(self.tok, "".join(m["content"] for m in messages), self.parse_special)
        def render(texts: list[str]) -> str:
            return self._delta([{**m, "content": t} for m, t in zip(messages, texts)], last_model_token)

        return encode_rendered(self.tok, render, [m["content"] for m in messages], self.parse_special)

    def _delta(self, messages: list[dict], last_model_token: int | None) -> str:
        marker = "\x00assistant\x00"
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
        head = self.tok.apply_chat_template(base, tokenize=False)
        full = self.tok.apply_chat_template(base + list(messages), tokenize=False, add_generation_prompt=True)
        if not full.startswith(head) or marker not in head:
            raise ConfigError("the chat template does not render a conversation as a prefix of its "
                              "continuation; multi-turn needs one that does", key="producer.episodes")
        closing = head[head.index(marker) + len(marker):]  # what follows an assistant turn
        if last_model_token is not None:
            stop = self.tok.decode([last_model_token], skip_special_tokens=False)
            if stop and closing.startswith(stop):
                closing = closing[len(stop):]  # sampled already
        return closing + full[len(head):]


@dataclass
class EpisodeState:
    group_id: str
    sample_idx: int
    group_size: int
    env: Any
    task: EpisodeTask
    prompt_ids: np.ndarray | None = None
    response: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: np.ndarray | None = None
    num_experts: int = 0
    turns: int = 0
    reward: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return f"{self.group_id}#{self.sample_idx}#t{self.turns}"

    def add_model_turn(self, s: FinishedSample) -> None:
        self.response += s.response_ids.tolist()
        self.mask += [True] * s.response_ids.size
        self.logprobs += np.minimum(s.logprobs, 0.0).tolist()
        self.versions += [v for v, n in s.token_versions for _ in range(n)]
        self.turns += 1
        if s.routed_experts is not None:  # rows 0 .. P+T-2 of this turn; keep the first computation
            have = 0 if self.routing is None else self.routing.shape[0]
            new = s.routed_experts[have:]
            self.routing = new if self.routing is None else np.concatenate([self.routing, new])
            self.num_experts = s.num_experts

    def add_observation(self, ids: list[int], version: int) -> None:
        self.response += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def to_finished(self, end: str) -> FinishedEpisode:
        return FinishedEpisode(
            group_id=self.group_id, sample_idx=self.sample_idx, group_size=self.group_size,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.response, dtype=np.int32), loss_mask=np.asarray(self.mask, dtype=bool),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int64), routed_experts=self.routing,
            num_experts=self.num_experts, reward=self.reward, end=end, turns=self.turns, info=self.info)


@dataclass
class FinishedEpisode:
    """One ended episode, as the runner hands it to the service."""

    group_id: str
    sample_idx: int
    group_size: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray  # int64[T], per token
    routed_experts: np.ndarray | None
    num_experts: int
    reward: float
    end: str
    turns: int
    info: dict

    def to_rollout(self, producer_id: str, sampling: SamplingConfig, prompt_text: str | None) -> Rollout:
        """The schema-2 record (schema 1 when no environment token was appended)."""
        change = np.flatnonzero(np.diff(self.versions)) + 1
        starts = np.r_[0, change]
        counts = np.diff(np.r_[starts, self.versions.size])
        runs = np.stack([self.versions[starts], counts], 1).astype(np.int64)
        info = {k: v for k, v in self.info.items() if isinstance(v, (str, int, float, bool))}
        info.update(end=self.end, turns=self.turns)
        return Rollout(
            rollout_id=Rollout.new_id(), group_id=self.group_id, sample_idx=self.sample_idx,
            group_size=self.group_size, prompt_ids=self.prompt_ids, response_ids=self.response_ids,
            logprobs=self.logprobs, policy_version=int(self.versions[0]), reward=float(self.reward),
            finish_reason=_FINISH[self.end], producer_id=producer_id, prompt_text=prompt_text,
            token_versions=runs if len(runs) > 1 else None, routed_experts=self.routed_experts,
            num_experts=self.num_experts if self.routed_experts is not None else 0,
            reward_info=info, sampling_digest=sampling.digest, model_digest=f"v{int(self.versions[0])}",
            temperature=float(sampling.temperature),
            loss_mask=None if self.loss_mask.all() else self.loss_mask)


class EpisodeRunner:
    """Many episodes in one `RolloutEngine`: the service's loop feeds it the engine's
    finished turns (`advance`), it submits each episode's next turn as soon as the
    environment answers and returns the episodes that ended. One thread (the engine's)
    calls it; environments run on its pool."""

    def __init__(self, engine, settings: EpisodeSettings, sampling: SamplingConfig,
                 env_factory: Callable[[], Environment], encoder: Callable | None = None):
        self.engine, self.settings, self._env_factory = engine, settings, env_factory
        stops = tuple(_single_token(engine, t) for t in env_factory().stop_texts)
        self.sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + stops)
        self.encode_observation = encoder or ObservationEncoder(
            engine.tokenizer(), parse_special=engine.settings.parse_special_tokens)
        self._pool = cf.ThreadPoolExecutor(settings.env_workers, thread_name_prefix="rlstream-env")
        self._turns: dict[str, EpisodeState] = {}  # request tag -> episode whose model turn is generating
        self._pending: dict[cf.Future, tuple[EpisodeState, float, str]] = {}  # env call -> (episode, deadline, kind)
        self._ended: list[FinishedEpisode] = []
        self._unrecorded: list[str] = []
        self.journal = None
        """producer/journal/ EpisodeJournal (the service sets it): every turn made durable."""
        self.active = 0
        """Episodes started and not ended."""

    def start(self, group_id: str, sample_idx: int, group_size: int, task: EpisodeTask) -> None:
        ep = EpisodeState(group_id, sample_idx, group_size, self._env_factory(), task)
        self.active += 1
        self._call(ep, "reset", ep.env.reset, task)

    def resume(self, ep: EpisodeState) -> None:
        """A journaled episode continues here from its last durable turn (producer/journal/resume.py)."""
        self.active += 1
        self._submit(ep)

    def has_work(self) -> bool:
        return self.active > 0

    def owns(self, tag: Any) -> bool:
        return tag in self._turns

    def advance(self, finished: list[FinishedSample], wait_s: float = 0.0) -> list[FinishedEpisode]:
        """Take the engine's finished turns, hand them to their environments, act on every
        environment answer (or deadline) so far, waiting up to `wait_s` for one; returns
        the episodes that ended."""
        for s in finished:
            ep = self._turns.pop(s.tag)
            ep.add_model_turn(s)
            turn = ModelTurn(self.engine.decode(s.response_ids), tuple(s.response_ids.tolist()),
                             str(s.finish_reason))
            if self.journal is not None:
                self.journal.on_model_turn(ep, turn)
            self._call(ep, "step", ep.env.step, turn)
        if wait_s and self._pending:
            cf.wait(list(self._pending), timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        self._collect()
        out, self._ended = self._ended, []
        return out

    def take_unrecorded(self) -> list[str]:
        """Group ids of the episodes that ended before their first model turn since the
        last call (one entry per episode): they publish nothing, but their samples are
        done (producer/groups.py `finish_sample`)."""
        out, self._unrecorded = self._unrecorded, []
        return out

    def abort_all(self) -> int:
        """Forget every episode (the engine's requests are aborted by its own abort_all)."""
        n = self.active
        for fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._turns.clear()
        self.active = 0
        return n

    def close(self) -> None:
        self.abort_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals

    def _call(self, ep: EpisodeState, kind: str, fn: Callable, arg: Any) -> None:
        self._pending[self._pool.submit(fn, arg)] = (ep, time.monotonic() + self.settings.step_timeout_s, kind)

    def _collect(self) -> None:
        now = time.monotonic()
        for fut in [f for f, (_, deadline, _) in self._pending.items() if f.done() or deadline <= now]:
            ep, _, kind = self._pending.pop(fut)
            if not fut.done():
                fut.cancel()
                self._end(ep, "step_timeout", f"{kind} took longer than {self.settings.step_timeout_s} s")
                continue
            try:
                result = fut.result()
            except Exception as e:  # noqa: BLE001 - any environment failure ends its episode, with the reason
                self._end(ep, "env_error", f"{kind} raised {type(e).__name__}: {e}"[:200])
                continue
            if kind == "reset":
                self._begin(ep, result)
            else:
                self._after_step(ep, result)

    def _begin(self, ep: EpisodeState, observation: Any) -> None:
        if not isinstance(observation, str) or not observation:
            self._end(ep, "env_error", f"reset returned {type(observation).__name__}, not a non-empty text")
            return
        ep.prompt_ids = self.engine.encode(observation)
        self._submit(ep)

    def _after_step(self, ep: EpisodeState, r: Any) -> None:
        if not isinstance(r, StepResult):
            self._end(ep, "env_error", f"step returned {type(r).__name__}, not a StepResult")
            return
        total = _reward_total(ep.reward, r.reward)
        if total is None:  # the record would be refused at publication (common/record.py's bound)
            self._end(ep, "env_error", f"step reward {repr(r.reward)[:40]} is not a finite number, or the "
                                       f"episode's total leaves [-{DEFAULT_LIMITS.max_abs_reward:g}, "
                                       f"{DEFAULT_LIMITS.max_abs_reward:g}]")
            return
        ep.reward = total
        ep.info.update(r.info)
        if r.done or r.observation is None:
            self._end(ep, "done")
        elif ep.turns >= self.settings.max_turns:
            self._end(ep, "max_turns")
        else:
            if not isinstance(r.observation, str):
                self._end(ep, "env_error", f"step returned a {type(r.observation).__name__} observation, not text")
                return
            try:
                ids = self.encode_observation(r.observation, ep.response[-1])
            except RewrittenSpecialText as e:
                self._end(ep, "env_error", f"observation: {e}"[:200])
                return
            if len(ep.response) + len(ids) + 1 > self._room(ep):
                self._end(ep, "max_tokens")
                return
            ep.add_observation(ids, self.engine.version)
            self._submit(ep)

    def _room(self, ep: EpisodeState) -> int:
        """Response tokens the episode may hold in all (its limit and the engine's context)."""
        return min(self.settings.max_episode_tokens,
                   self.engine.settings.max_model_len - len(ep.prompt_ids))

    def _submit(self, ep: EpisodeState) -> None:
        budget = min(self.settings.max_turn_tokens, self._room(ep) - len(ep.response))
        if budget < 1:
            self._end(ep, "max_tokens")
            return
        if self.journal is not None:
            self.journal.on_turn(ep)
        ids = np.concatenate([ep.prompt_ids, np.asarray(ep.response, dtype=np.int32)])
        self.engine.submit_group(ids, n=1, sampling=dataclasses.replace(self.sampling, max_tokens=budget),
                                 tag=ep.tag)
        self._turns[ep.tag] = ep

    def _end(self, ep: EpisodeState, end: str, error: str | None = None) -> None:
        telemetry.EPISODES.labels(end=end).inc()
        self.active -= 1
        if error is not None:
            ep.info["error"] = error
        if self.journal is not None:
            self.journal.on_end(ep, recorded=bool(ep.response))
        if not ep.response:  # ended before its first model turn: no record can be made (its
            self._unrecorded.append(ep.group_id)  # group is timed out by the consumer, like an
            return                                # aborted sample; the producer releases its slot)
        self._ended.append(ep.to_finished(end))


def _reward_total(so_far: float, step_reward: Any) -> float | None:
    """The episode's reward after a step, or None if it is no finite number within the record's bound."""
    if isinstance(step_reward, bool) or not isinstance(step_reward, numbers.Real):  # numpy scalars are Real
        return None
    total = so_far + float(step_reward)
    return total if math.isfinite(total) and abs(total) <= DEFAULT_LIMITS.max_abs_reward else None


def _single_token(engine, text: str) -> int:
    # parsed: a stop text that names a special token means that token (the environment's code, trusted)
    ids = encode_text(engine.tokenizer(), text, parse_special=True)
    if len(ids) != 1:
        raise ConfigError(f"the environment's stop text {text!r} is {len(ids)} tokens of this model, "
                          "not one (vLLM stops on token ids)", key="producer.episodes.env")
    return int(ids[0])
