"""The agent endpoint's OpenAI chat-completions protocol (docs/multi-turn.md "Black-box
agents"): requests parsed and validated, response and error bodies built. Pure
functions of their arguments: the episodes and the engine are producer/rollout/agents/driver.py's,
the HTTP server producer/rollout/agents/http.py.

Requests. Every field is type-checked before use: a wrong one is a 400 naming it
(`BadParameter`, the field in the error body's `param`). Sampling is the producer's: a
request's temperature or top_p must be absent or equal to it, penalties absent or 0
(the record carries one sampling distribution for the trainer). Tool calls, streaming,
n > 1 and top_logprobs are refused; content is text (a list of text parts is joined).

History (token-in, token-out). A call repeats the episode's messages so far exactly
(the assistant messages as this endpoint returned them) and appends only tool, user
or system messages (`new_messages`); a call whose history differs is refused (409
`history_mismatch`, naming the first differing message).

Responses. `completion` is the chat.completion object of a finished turn plus
`rlstream`: its token ids, log-probs and per-token versions as the record holds them.
`reported_reward` and `reward_info` check a reward call's body; `error_body` is
OpenAI's error shape.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlstream.common.errors import AgentRequestError
from rlstream.common.record import DEFAULT_LIMITS
from rlstream.producer.sample import FinishedSample, SamplingConfig

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


@dataclass(frozen=True)
class ChatCall:
    """A validated chat-completions request."""

    messages: list[dict]
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool



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
    for key, ours in (("temperature", sampling.temperature), ("top_p", sampling.top_p)) +\
            tuple((k, 0.0) for k in PENALTIES):
        v = _number(body, key)
        if v is not None and v != ours:
            raise BadParameter(key, f"the producer samples with {ours} (the record carries one sampling "
                                    f"distribution for the trainer); send {ours} or leave it out")


def _stops(raw: Any) -> tuple[str, ...]:
    stop = () if raw is None else (raw,) if isinstance(raw, str) else raw
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS\
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


def templated(render: Callable[[], Any]) -> Any:
    """Run a chat-template rendering; a template that refuses the messages is a 400."""
    try:
        return render()
    except AgentRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 raises its own errors (e.g. "roles must alternate")
        raise AgentRequestError(400, f"messages: the model's chat template refused them: {e}"[:300]) from e


def reported_reward(body: dict) -> float:
    """The agent's reward: a finite number within the record's bound (a record beyond it
    would be refused at publication, after the episode was already closed)."""
    reward, bound = _number(body, "reward"), DEFAULT_LIMITS.max_abs_reward
    if abs(reward) > bound:
        raise BadParameter("reward", f"{reward:g} is outside [-{bound:g}, {bound:g}] (common/record/schema.py)")
    return reward


def reward_info(raw: Any) -> dict:
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


# --------------------------------------------------------------------------- responses

def completion(s: FinishedSample, text: str, episode_id: str, turn: int, response_tokens: int, engine,
               logprobs: bool) -> dict:
    """The chat.completion object of a finished turn, plus `rlstream`: its token ids,
    log-probs and per-token versions exactly as the record will hold them. `turn` and
    `response_tokens`: the episode's turns and response tokens, this turn included;
    `engine`: its tokenizer (the `logprobs` tokens) and model name."""
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
        "id": f"chatcmpl-{episode_id}-{turn}", "object": "chat.completion", "created": int(time.time()),
        "model": engine.model_dir.name, "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                  "total_tokens": prompt_tokens + len(ids)},
        "rlstream": {"episode_id": episode_id, "turn": turn, "token_ids": ids, "logprobs": lps,
                     "token_versions": [[int(v), int(n)] for v, n in s.token_versions],
                     "response_offset": response_tokens - len(ids)},
    }


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape; `param` names the request field at fault when there is one."""
    err = {"message": message, "type": kind}
    if param is not None:
        err["param"] = param
    return {"error": err}
