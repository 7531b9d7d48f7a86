"""Black-box agents: episodes driven over an OpenAI-compatible chat-completions API
(docs/multi-turn.md "Black-box agents"; HTTP in producer/agent_http.py).

An agent program (any harness) opens a group of G episodes, drives each one with
chat-completions calls against the episode's base URL, and closes it with a reward
(or asks the producer's verifier to score it). The producer records every call
token-in/token-out and publishes the episode as one record through the outbox, the
same path and validation as every other sample.

Threads. HTTP threads only parse and wait: every request becomes a command on
`AgentEpisodes.inbox`, run by the service's loop on the engine's thread (`poll`),
which owns every episode, the tokenizer and the engine. A call's turn is generated
by the producer's one RolloutEngine, batched with everything else; `claim` takes
the engine's finished agent turns and answers the waiting calls.

Token-in, token-out. The first call's messages are rendered with the chat template
(generation prompt added) and tokenised: the record's prompt. Every later call must
repeat the episode's messages so far exactly (the assistant messages as this
endpoint returned them) and append only tool, user or system messages; those are
tokenised once as a delta after the model's turn (`ObservationEncoder.messages`) and
appended with loss mask 0. The model's sampled tokens are never re-tokenised. A call
whose history differs is refused (409 `history_mismatch`, naming the first differing
message); the episode stays as it was, so the agent may retry with the right history.

Limits (producer.episodes): `max_turns` calls, `max_turn_tokens` per call (a
request's max_tokens is clamped to it), `max_episode_tokens` response tokens;
a call beyond them is refused (400 `max_turns` / `max_tokens`) and the episode waits
for its reward. Sampling is the producer's: a request's temperature or top_p must
be absent or equal to it (the record carries one temperature for the trainer). Every
request field is type-checked before use: a wrong one is a 400 naming it (`BadParameter`).

Ends (`rlstream_producer_episodes_total{end}`): `reported` (the agent's reward),
`verified` (the task's verifier scored the last assistant message), both published;
`abandoned` (no call and no turn generating for `idle_timeout_s`) and `shutdown`,
never published (a fabricated reward would be trained on; the consumer times the
incomplete group out, as for an aborted sample). An episode closed before its first
call publishes nothing either. A generating turn always finishes (bounded by its
max_tokens), so an abandoned episode never holds engine capacity.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import math

import numpy as np

from common.config import AgentEndpointSettings, EpisodeSettings
from common.errors import AgentRequestError
from common.record import DEFAULT_LIMITS, Rollout
from producer import telemetry
from producer.episodes import EpisodeState, ObservationEncoder
from producer.groups import GroupInfo, InFlightGroups
from producer.sample import FinishedSample, SamplingConfig
from producer.text_tokens import encode_rendered, encode_text

log = logging.getLogger("rlstream.producer.agents")

END_REASONS = ("reported", "verified", "abandoned", "shutdown")
ROLES = ("system", "user", "assistant", "tool")
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias")
PENALTIES = ("presence_penalty", "frequency_penalty")
"""Sampling transforms the producer never applies: absent or 0 (the trainer could not reproduce them)."""
MAX_STOPS = 4


class BadParameter(AgentRequestError):
    """A request field of the wrong type or value: 400, the field in the message and
    in the error body's `param` (as OpenAI names it), never a 500 from deeper down."""

    def __init__(self, param: str, why: str):
        super().__init__(400, f"{param}: {why}")
        self.param = param


class AgentTag(NamedTuple):
    """The engine tag of an agent's turn (never a group id of the producer's own)."""

    episode_id: str
    turn: int

    def __str__(self) -> str:
        return f"agent-{self.episode_id}-t{self.turn}"


@dataclass(frozen=True)
class AgentTask:
    """What a group of agent episodes works on; `score(text) -> (reward, info)` or None."""

    prompt_text: str
    answer: str
    score: Callable[[str], tuple[float, dict]] | None


@dataclass(frozen=True)
class ChatCall:
    """A validated chat-completions request."""

    messages: list[dict]
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool


@dataclass
class AgentEpisode:
    id: str
    state: EpisodeState
    task: AgentTask
    history: list[dict] = field(default_factory=list)
    """The messages so far, assistant turns as returned: what the next call must repeat."""
    waiting: cf.Future | None = None
    """The call whose turn is generating."""
    last_seen: float = field(default_factory=time.monotonic)
    logprobs_wanted: bool = False
    """The generating call asked for OpenAI `logprobs`."""


def task_for(body: dict, prompts, verify) -> AgentTask | str:
    """A new group's task: the agent's own (`prompt`, optional `answer`: scored by
    `verify` when given) or the next of the producer's prompt source ("no_prompts" when dry)."""
    if body.get("prompt") is not None:
        prompt, answer = body["prompt"], body.get("answer")
        if not isinstance(prompt, str) or not prompt:
            raise BadParameter("prompt", "a non-empty string")
        if answer is None:
            return AgentTask(prompt, "", None)
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise BadParameter("answer", "a string or a number (what the producer's verifier compares with)")
        return AgentTask(prompt, str(answer), lambda text: verify(text, str(answer)))
    p = prompts.take()
    if p is None:
        telemetry.HELD_BACK.labels(reason="no_prompts").inc()
        return "no_prompts"
    return AgentTask(p.text, p.answer, p.score or (lambda text: verify(text, p.answer)))


# --------------------------------------------------------------------------- requests

def parse_chat(body: dict, sampling: SamplingConfig) -> ChatCall:
    """Validate an OpenAI chat-completions body; BadParameter (400) names the field to fix.
    Every field is type-checked here, so a wrong type is a 400, never a 500 from code below."""
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise BadParameter(key, "not supported; tool calls are parsed from the content by the agent, "
                                    "tool results come back as role 'tool' messages")
    if _flag(body, "stream"):
        raise BadParameter("stream", "not supported; send stream false")
    if _integer(body, "n", 1) != 1:
        raise BadParameter("n", "must be 1 (a group's G samples are G episodes)")
    _same_sampling(body, sampling)
    if _integer(body, "top_logprobs", 0) != 0:
        raise BadParameter("top_logprobs", "only the sampled token's log-prob is available (0)")
    max_tokens = _integer(body, "max_tokens", None, lo=1)
    max_tokens = _integer(body, "max_completion_tokens", max_tokens, lo=1)
    logprobs = _flag(body, "logprobs")
    return ChatCall(parse_messages(body.get("messages")), max_tokens, _stops(body.get("stop")), logprobs)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadParameter(key, f"true or false, got {_shown(v)}")
    return bool(v)


def _integer(body: dict, key: str, default: int | None, lo: int = 0) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadParameter(key, f"an integer >= {lo}, got {_shown(v)}")
    return v


def _number(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadParameter(key, f"a finite number, got {_shown(v)}")
    return float(v)


def _same_sampling(body: dict, sampling: SamplingConfig) -> None:
    """Sampling is the producer's: the record carries one temperature for the trainer."""
    for key, ours in (("temperature", sampling.temperature), ("top_p", sampling.top_p)) + \
            tuple((k, 0.0) for k in PENALTIES):
        v = _number(body, key)
        if v is not None and v != ours:
            raise BadParameter(key, f"the producer samples with {ours} (the record carries one sampling "
                                    f"distribution for the trainer); send {ours} or leave it out")


def _stops(raw: Any) -> tuple[str, ...]:
    stop = () if raw is None else (raw,) if isinstance(raw, str) else raw
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS \
            or not all(isinstance(s, str) and s for s in stop):
        raise BadParameter("stop", f"a string or a list of at most {MAX_STOPS} non-empty strings, "
                                   f"got {_shown(raw)}")
    return tuple(stop)


def _shown(v: Any) -> str:
    """A refused value as the error shows it (short: it is the sender's)."""
    return repr(v)[:40]


def parse_messages(raw: Any) -> list[dict]:
    """[{role, content}] with text content (a list of text parts is joined)."""
    if not isinstance(raw, list) or not raw:
        raise BadParameter("messages", "a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise BadParameter(f"messages[{i}].role", f"one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                       for p in content):
                raise BadParameter(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise BadParameter(f"messages[{i}].content", "text expected")
        if m.get("tool_calls"):
            raise BadParameter(f"messages[{i}].tool_calls", "not supported; send the content this endpoint "
                                                            "returned")
        out.append({"role": m["role"], "content": content})
    return out


def new_messages(history: list[dict], messages: list[dict]) -> list[dict]:
    """The messages a call adds to an episode's history (token-in, token-out: the
    history must come back exactly, and a call adds only non-assistant messages)."""
    if len(messages) <= len(history):
        raise AgentRequestError(409, f"messages: {len(messages)} messages do not extend the episode's "
                                     f"{len(history)}; repeat them and add the tool/user message", "history_mismatch")
    for i, (ours, theirs) in enumerate(zip(history, messages)):
        if ours != theirs:
            raise AgentRequestError(409, f"messages[{i}] differs from the episode's history (the episode "
                                         f"records tokens, not text: send the {ours['role']} message as it "
                                         "was sent or returned)", "history_mismatch")
    added = messages[len(history):]
    for j, m in enumerate(added, start=len(history)):
        if m["role"] == "assistant":
            raise AgentRequestError(409, f"messages[{j}]: an assistant message this endpoint did not "
                                         "generate; only tool, user or system messages may be added",
                                    "history_mismatch")
    return added


# --------------------------------------------------------------------------- episodes

class AgentEpisodes:
    """Every agent episode of a producer, on the engine's thread (see the module doc).

    `call(kind, episode_id, body)` is the HTTP threads' entry (thread-safe: a queue);
    the service loop runs `poll()` (commands, idle ends; returns records to publish)
    and passes the engine's finished samples through `claim()`.
    """

    def __init__(self, engine, settings: AgentEndpointSettings, limits: EpisodeSettings,
                 sampling: SamplingConfig, groups: InFlightGroups, group_size: int,
                 take_task: Callable[[dict], AgentTask | str], producer_id: str):
        self.engine, self.settings, self.limits = engine, settings, limits
        self.sampling, self.groups, self.group_size = sampling, groups, group_size
        self.take_task, self.producer_id = take_task, producer_id
        self.encoder = ObservationEncoder(engine.tokenizer(), parse_special=engine.settings.parse_special_tokens)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.episodes: dict[str, AgentEpisode] = {}
        self._turns: dict[AgentTag, AgentEpisode] = {}
        self._published: list[Rollout] = []
        self.closed = False
        self.base_url = ""  # set by the HTTP server once it listens

    # -- HTTP threads

    def call(self, kind: str, episode_id: str | None, body: dict, timeout_s: float) -> tuple[int, dict]:
        """Run a command on the engine's thread; (status, JSON body)."""
        if self.closed:
            return 503, error_body("the producer is shutting down", "unavailable")
        fut: cf.Future = cf.Future()
        self.inbox.put((kind, episode_id, body, fut))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:  # in slices: a call queued as the producer shuts down is not left waiting
                return fut.result(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except cf.TimeoutError:
                if self.closed and not fut.done():
                    return 503, error_body("the producer is shutting down", "unavailable")
        return 504, error_body(f"no answer within {timeout_s:.0f} s (a generating turn is still recorded: the "
                           "episode's history holds it; GET the episode for its messages)", "timeout")

    # -- engine thread

    def poll(self) -> list[Rollout]:
        """Run queued commands, end idle episodes; returns the records to publish."""
        while True:
            try:
                kind, eid, body, fut = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._run(kind, eid, body, fut)
        self._end_idle()
        out, self._published = self._published, []
        return out

    def claim(self, finished: list[FinishedSample]) -> list[FinishedSample]:
        """Take the agents' finished turns (answering their calls); returns the rest."""
        rest = []
        for s in finished:
            if not isinstance(s.tag, AgentTag):
                rest.append(s)
                continue
            ep = self._turns.pop(s.tag, None)
            if ep is not None:  # None: its episode ended at shutdown
                self._finish_turn(ep, s)
        return rest

    def has_work(self) -> bool:
        return bool(self._turns)

    def shutdown(self) -> None:
        """Refuse new calls, answer waiting ones with 503, end every open episode (`shutdown`)."""
        self.closed = True
        self.poll()  # answer what was queued before closing
        for ep in list(self.episodes.values()):
            if ep.waiting is not None and not ep.waiting.done():
                ep.waiting.set_result((503, error_body("the producer is shutting down", "unavailable")))
            self._end(ep, "shutdown")
        self._turns.clear()

    # -- commands

    def _run(self, kind: str, eid: str | None, body: dict, fut: cf.Future) -> None:
        try:
            if self.closed:
                raise AgentRequestError(503, "the producer is shutting down", "unavailable")
            if kind == "open":
                fut.set_result((200, self._open_group(body)))
                return
            ep = self._episode(eid)
            if kind == "chat":
                self._chat(ep, parse_chat(body, self.sampling), fut)  # answered when the turn finishes
            elif kind == "reward":
                fut.set_result((200, self._reward(ep, body)))
            else:
                fut.set_result((200, self._describe(ep)))
        except AgentRequestError as e:
            telemetry.AGENT_REFUSED.labels(kind=e.kind).inc()
            fut.set_result((e.status, error_body(str(e), e.kind, getattr(e, "param", None))))
        except Exception as e:  # noqa: BLE001 - one agent's request must not stop the producer's loop
            log.exception("agent request %s on episode %s failed", kind, eid)
            telemetry.AGENT_REFUSED.labels(kind="internal_error").inc()
            fut.set_result((500, error_body(f"{type(e).__name__}: {e}"[:300], "internal_error")))

    def _episode(self, eid: str | None) -> AgentEpisode:
        ep = self.episodes.get(eid or "")
        if ep is None:
            raise AgentRequestError(404, f"no open episode {eid!r} (ended, or never opened)", "not_found")
        ep.last_seen = time.monotonic()
        return ep

    def _open_group(self, body: dict) -> dict:
        if len(self.episodes) + self.group_size > self.settings.max_open_episodes:
            raise AgentRequestError(429, f"{len(self.episodes)} episodes open (producer.agent_endpoint."
                                         "max_open_episodes); close some first", "open_episodes")
        task = self.take_task(body)
        if isinstance(task, str):
            raise AgentRequestError(429, f"admission holds new groups ({task}); retry later", task)
        gid = self.groups.new_id()
        self.groups.add(gid, GroupInfo(task.prompt_text, task.answer, None, self.group_size, task.score))
        out = []
        for i in range(self.group_size):
            eid = secrets.token_hex(8)
            state = EpisodeState(gid, i, self.group_size, None, None)
            self.episodes[eid] = AgentEpisode(eid, state, task)
            out.append({"episode_id": eid, "base_url": f"{self.base_url}/v1/episodes/{eid}"})
        return {"group_id": gid, "prompt": task.prompt_text, "episodes": out}

    def _chat(self, ep: AgentEpisode, req: ChatCall, fut: cf.Future) -> None:
        st = ep.state
        if ep.waiting is not None:
            raise AgentRequestError(409, "a call of this episode is generating; wait for its answer", "busy")
        if st.turns >= self.limits.max_turns:
            raise AgentRequestError(400, f"the episode made {st.turns} calls (producer.episodes.max_turns); "
                                         "report its reward", "max_turns")
        stops = tuple(self._stop_token(s) for s in req.stop)
        if st.prompt_ids is None:
            prompt = self._render_prompt(req.messages)
            added: list[int] = []
        else:
            prompt = st.prompt_ids
            added = _templated(lambda: self.encoder.messages(new_messages(ep.history, req.messages),
                                                             st.response[-1]))
        room = min(self.limits.max_episode_tokens, self.engine.settings.max_model_len - len(prompt))
        budget = min(req.max_tokens or self.limits.max_turn_tokens, self.limits.max_turn_tokens,
                     room - len(st.response) - len(added))
        if budget < 1:
            raise AgentRequestError(400, f"no room for another turn ({len(st.response) + len(added)} of {room} "
                                         "response tokens: producer.episodes.max_episode_tokens and the "
                                         "engine's max_model_len); report the reward", "max_tokens")
        st.prompt_ids = prompt
        st.add_observation(added, self.engine.version)
        ep.history, ep.waiting = list(req.messages), fut
        tag = AgentTag(ep.id, st.turns)
        sampling = dataclasses.replace(self.sampling, max_tokens=budget,
                                       stop_token_ids=tuple(self.sampling.stop_token_ids) + stops)
        ids = np.concatenate([st.prompt_ids, np.asarray(st.response, dtype=np.int32)])
        self.engine.submit_group(ids, n=1, sampling=sampling, tag=tag)
        self._turns[tag] = ep
        ep.logprobs_wanted = req.logprobs

    def _render_prompt(self, messages: list[dict]) -> np.ndarray:
        if messages[-1]["role"] == "assistant":
            raise AgentRequestError(400, "messages: the first call must end with a user (or system) message")
        tok, parse = self.engine.tokenizer(), self.engine.settings.parse_special_tokens
        contents = [m["content"] for m in messages]
        if getattr(tok, "chat_template", None) is None:  # the tiny toy model: plain text, as the environments
            ids = encode_text(tok, "".join(contents), parse)
        else:  # the template's markers parsed, a special token's text in a message not (producer/text_tokens.py)
            def render(texts: list[str]) -> str:
                return tok.apply_chat_template([{**m, "content": t} for m, t in zip(messages, texts)],
                                               tokenize=False, add_generation_prompt=True)

            ids = _templated(lambda: encode_rendered(tok, render, contents, parse))
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size == 0 or ids.size >= self.engine.settings.max_model_len:
            raise AgentRequestError(400, f"messages: a prompt of {ids.size} tokens (the engine's max_model_len "
                                         f"is {self.engine.settings.max_model_len})", "max_tokens")
        return ids

    def _stop_token(self, text: str) -> int:
        # parsed: a stop naming a special token means that token (stopping is all it can do)
        ids = encode_text(self.engine.tokenizer(), text, parse_special=True)
        if len(ids) != 1:
            raise AgentRequestError(400, f"stop: {text!r} is {len(ids)} tokens of this model; each stop "
                                         "must be one token (the engine stops on token ids)")
        return int(ids[0])

    def _finish_turn(self, ep: AgentEpisode, s: FinishedSample) -> None:
        ep.state.add_model_turn(s)
        text = self.engine.decode(s.response_ids)
        ep.history.append({"role": "assistant", "content": text})
        ep.last_seen = time.monotonic()
        fut, ep.waiting = ep.waiting, None
        if fut is not None and not fut.done():
            telemetry.AGENT_CALLS.inc()
            fut.set_result((200, completion(ep, s, text, self.engine, ep.logprobs_wanted)))

    def _reward(self, ep: AgentEpisode, body: dict) -> dict:
        if ep.waiting is not None:
            raise AgentRequestError(409, "a call of this episode is generating; wait for its answer", "busy")
        reward, info = body.get("reward"), _info(body.get("info"))
        if reward is None:
            if ep.task.score is None:
                raise AgentRequestError(400, "reward: required (this group's task has no verifier: its prompt "
                                             "came with no answer)")
            last = ep.history[-1]["content"] if ep.state.turns else ""
            reward, vinfo = ep.task.score(last)
            info, end = {**vinfo, **info}, "verified"
        else:
            reward, end = _reported_reward(body), "reported"
        ep.state.reward = float(reward)
        ep.state.info.update(info)
        published = self._end(ep, end)
        return {"episode_id": ep.id, "end": end, "reward": float(reward), "turns": ep.state.turns,
                "published": published}

    def _describe(self, ep: AgentEpisode) -> dict:
        st = ep.state
        return {"episode_id": ep.id, "group_id": st.group_id, "sample_idx": st.sample_idx, "turns": st.turns,
                "response_tokens": len(st.response), "generating": ep.waiting is not None,
                "messages": ep.history}

    def _end_idle(self) -> None:
        cutoff = time.monotonic() - self.settings.idle_timeout_s
        for ep in [e for e in self.episodes.values() if e.waiting is None and e.last_seen < cutoff]:
            log.warning("agent episode %s: no call for %.0f s, ended (abandoned)", ep.id, self.settings.idle_timeout_s)
            self._end(ep, "abandoned")

    def _end(self, ep: AgentEpisode, end: str) -> bool:
        """Forget the episode (its group sample counted done); True if published."""
        del self.episodes[ep.id]
        telemetry.EPISODES.labels(end=end).inc()
        info = self.groups.finish_sample(ep.state.group_id)
        if end not in ("reported", "verified") or not ep.state.turns:
            return False
        finished = ep.state.to_finished(end)
        self._published.append(finished.to_rollout(self.producer_id, self.sampling, prompt_text=info.prompt_text))
        return True


# --------------------------------------------------------------------------- responses

def completion(ep: AgentEpisode, s: FinishedSample, text: str, engine, logprobs: bool) -> dict:
    """The chat.completion object of a finished turn, plus `rlstream`: its token ids,
    log-probs and per-token versions exactly as the record will hold them."""
    ids = s.response_ids.tolist()
    lps = np.minimum(s.logprobs, 0.0).tolist()
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": "length" if s.finish_reason == "length" else "stop",
                              "logprobs": None}
    if logprobs:
        tok = engine.tokenizer()
        choice["logprobs"] = {"content": [
            {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()), "top_logprobs": []}
            for t, lp in zip(ids, lps)]}
    prompt_tokens = int(s.prompt_ids.size)
    return {
        "id": f"chatcmpl-{ep.id}-{ep.state.turns}", "object": "chat.completion", "created": int(time.time()),
        "model": engine.model_dir.name, "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                  "total_tokens": prompt_tokens + len(ids)},
        "rlstream": {"episode_id": ep.id, "turn": ep.state.turns, "token_ids": ids, "logprobs": lps,
                     "token_versions": [[int(v), int(n)] for v, n in s.token_versions],
                     "response_offset": len(ep.state.response) - len(ids)},
    }


def _templated(render: Callable[[], Any]) -> Any:
    """Run a chat-template rendering; a template that refuses the messages is a 400."""
    try:
        return render()
    except AgentRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 raises its own errors (e.g. "roles must alternate")
        raise AgentRequestError(400, f"messages: the model's chat template refused them: {e}"[:300]) from e


def _reported_reward(body: dict) -> float:
    """The agent's reward: a finite number within the record's bound (a record beyond it
    would be refused at publication, after the episode was already closed)."""
    reward, bound = _number(body, "reward"), DEFAULT_LIMITS.max_abs_reward
    if abs(reward) > bound:
        raise BadParameter("reward", f"{reward:g} is outside [-{bound:g}, {bound:g}] (common/record.py)")
    return reward


def _info(raw: Any) -> dict:
    """The reward's `info`: a map of scalars (it goes into the record's reward_info, which
    msgpack must encode: no integer beyond 64 bits, no deep nesting)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadParameter("info", f"an object of scalar values, got {_shown(raw)}")
    for k, v in raw.items():
        ok = v is None or isinstance(v, (str, bool, float)) or (isinstance(v, int) and -2**63 <= v < 2**64)
        if not ok:
            raise BadParameter(f"info.{k[:40]}", f"a string, number, boolean or null, got {_shown(v)}")
    return raw


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape; `param` names the request field at fault when there is one."""
    err = {"message": message, "type": kind}
    if param is not None:
        err["param"] = param
    return {"error": err}
