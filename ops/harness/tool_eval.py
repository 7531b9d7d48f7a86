"""Held-out accuracy WITH the tool: the producer's environment, driven by the HF model.

    from rlstream.harness.tool_eval import run_episodes, tool_scores
    outs = run_episodes(model, tok, problems, cfg.producer.episodes)      # greedy
    scores = tool_scores(model, tok, problems, cfg.producer.episodes, "avg@8")

Each held-out problem is one episode of the environment the producer trains in
(`producer.episodes.env`, common/tasks/envs/), under the same limits
(`max_turns`, `max_turn_tokens`, `max_episode_tokens`) and the same turn
stops (the environment's `stop_texts` and EOS): reset with the prompt, then
model turn -> `env.step` -> observation appended -> next model turn, until the
environment says done (its reward is the task's exact match of the final
answer) or a limit ends it (reward 0). Decoding is HF fp32 on CPU with a KV
cache (ops/harness/hf_decode.py `decode_loop`), all live episodes of a turn
batched by length; prompts and observations are tokenised as the producer does
(producer/text_tokens.py, producer/rollout/observation.py `ObservationEncoder`): a special
token's text in them ("<eos>" from a tool) is ordinary text, never the token
itself, so the harness scores the episodes the producer would generate.
Environment steps run
inline: the calculator is pure and instant (the producer's step timeout and
failure handling are not exercised here).

WITHOUT the tool is single-turn on the same prompts
(`rlstream.harness.evaluate.heldout_scores`): a model that answers with a call
there is simply wrong, which is the honest price of relying on the tool.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from rlstream.common.config import EpisodeSettings
from rlstream.common.errors import ConfigError
from rlstream.common.tasks.arithmetic import Problem, is_correct
from rlstream.common.tasks.environment import ModelTurn
from rlstream.common.tasks.envs import env_factory
from rlstream.common.tasks.task import Task
from rlstream.harness.hf_decode import by_length, decode_loop
from rlstream.producer.rollout.observation import ObservationEncoder
from rlstream.producer.text_tokens import encode_text


@dataclass
class EpisodeOutcome:
    transcript: str
    """Prompt, model turns and observations as text (EOS not shown)."""
    reward: float
    tool_calls: int
    """The environment's own count (its `calls` attribute, as the calculator keeps; else 0)."""
    end: str
    """done | max_turns | max_tokens (as the producer's reward_info["end"])."""


@dataclass
class _Live:
    env: object
    ids: list[int]
    transcript: str
    response_len: int = 0
    outcome: EpisodeOutcome | None = None


def _env_class(settings: EpisodeSettings):
    return env_factory(settings)


def _stop_ids(tok, env_cls) -> frozenset[int]:
    ids = [tok.encode(t, add_special_tokens=False) for t in env_cls.stop_texts]
    if any(len(i) != 1 for i in ids):
        raise ConfigError(f"every stop text of {env_cls.__name__} must be one token of the model",
                          key="producer.episodes.env")
    return frozenset(i[0] for i in ids)


def _start(env_cls, tok, problem: Problem) -> _Live:
    env = env_cls()
    task = Task(problem.prompt, problem.answer, lambda text, a=problem.answer: (float(is_correct(text, a)), {}))
    prompt = env.reset(task)
    return _Live(env, encode_text(tok, prompt), prompt)


def _end(ep: _Live, reward: float, end: str) -> None:
    ep.outcome = EpisodeOutcome(ep.transcript, reward, getattr(ep.env, "calls", 0), end)


def _take_turn(ep: _Live, out: list[int], tok, settings: EpisodeSettings, stops: frozenset[int]) -> None:
    """Append one model turn (`out` as decoded: an ending EOS was dropped and is put back), step the
    environment, append its observation or end the episode."""
    if len(out) < settings.max_turn_tokens and not (out and out[-1] in stops):
        out = out + [tok.eos_token_id]  # ended by EOS, which the producer's turn includes
    stopped = out[-1] in stops or out[-1] == tok.eos_token_id
    room = settings.max_episode_tokens - ep.response_len
    if len(out) > room:  # the episode's token budget ends this turn
        out, stopped = out[:room], False
    turn = ModelTurn(tok.decode(out, skip_special_tokens=True), tuple(out), "stop" if stopped else "length")
    ep.ids += out
    ep.response_len += len(out)
    ep.transcript += turn.text
    result = ep.env.step(turn)
    if result.done or result.observation is None:
        return _end(ep, float(result.reward), "done")
    obs = ObservationEncoder(tok)(result.observation, out[-1])  # the producer's encoding of it
    if ep.response_len + len(obs) + 1 > settings.max_episode_tokens:
        return _end(ep, 0.0, "max_tokens")
    ep.ids += obs
    ep.response_len += len(obs)
    ep.transcript += result.observation


def run_episodes(model, tok, problems: list[Problem], settings: EpisodeSettings, temperature: float = 0.0,
                 seed: int = 0, batch_size: int = 256) -> list[EpisodeOutcome]:
    """One episode per problem (greedy when temperature == 0), in order."""
    import torch

    env_cls = _env_class(settings)
    stops = _stop_ids(tok, env_cls)
    live = [_start(env_cls, tok, p) for p in problems]
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for _ in range(settings.max_turns):
            active = [ep for ep in live if ep.outcome is None]
            if not active:
                break
            for _, idx in sorted(by_length([ep.ids for ep in active]).items()):
                for s in range(0, len(idx), batch_size):
                    chunk = [active[i] for i in idx[s:s + batch_size]]
                    outs = decode_loop(model, [ep.ids for ep in chunk], settings.max_turn_tokens,
                                        tok.eos_token_id, temperature, gen, stops)
                    for ep, out in zip(chunk, outs):
                        _take_turn(ep, out, tok, settings, stops)
    for ep in live:
        if ep.outcome is None:
            _end(ep, 0.0, "max_turns")
    return [ep.outcome for ep in live]


def tool_scores(model, tok, problems: list[Problem], settings: EpisodeSettings, metric: str = "greedy",
                temperature: float = 1.0, seed: int = 0, n_examples: int = 6) -> dict:
    """Held-out scores with the tool, keyed as `evaluate.heldout_scores`'s.

    {"metric", "accuracy" (the metric's value), "greedy", "avg"/"pass" (avg@k),
    "call_rate" (share of greedy episodes with at least one tool call),
    "calls_per_episode", "ends" (greedy end reasons), "examples", "seconds"}.
    """
    t0 = time.perf_counter()
    greedy = run_episodes(model, tok, problems, settings)
    n = max(len(problems), 1)
    ends: dict[str, int] = {}
    for o in greedy:
        ends[o.end] = ends.get(o.end, 0) + 1
    out = {"metric": metric, "greedy": sum(o.reward > 0 for o in greedy) / n,
           "call_rate": sum(o.tool_calls > 0 for o in greedy) / n,
           "calls_per_episode": sum(o.tool_calls for o in greedy) / n, "ends": ends,
           "examples": [o.transcript for o in greedy[:n_examples]]}
    if metric == "greedy":
        out["accuracy"] = out["greedy"]
    elif metric.startswith("avg@") and metric[4:].isdigit():
        k = int(metric[4:])
        sampled = run_episodes(model, tok, [p for p in problems for _ in range(k)], settings, temperature, seed)
        hits = [o.reward > 0 for o in sampled]
        out["accuracy"] = out["avg"] = sum(hits) / max(len(hits), 1)
        out["pass"] = sum(any(hits[i * k:(i + 1) * k]) for i in range(len(problems))) / n
    else:
        raise ConfigError(f"unknown held-out metric {metric!r}: use 'greedy' or 'avg@K'", key="demo.eval_metric")
    out["seconds"] = time.perf_counter() - t0
    return out
