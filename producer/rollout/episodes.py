"""Multi-turn episodes: the runner that interleaves many episodes in one engine,
and the `Episodes` rollout driver over it (docs/multi-turn.md).

An environment (common/tasks/envs/) follows `Environment` (common/tasks/environment.py):

    observation = env.reset(task)                            # text: the prompt
    result = env.step(ModelTurn(text, token_ids, finish))    # StepResult(observation, reward, done, info)

`EpisodeRunner` drives one episode (a `Trajectory`) per sample. Every reset and step runs on a
thread pool (never on the engine's thread) with a deadline
(`producer.episodes.step_timeout_s`); a step that raises or misses its deadline
ends the episode with a reason, counted in `rlstream_producer_episodes_total{end}`
and written to `reward_info["end"]`. The episode is still published (reward so
far) so that its group completes. A timed-out step's thread is abandoned, not
killed: an environment must not block forever.

Token-in, token-out. The model's turn is appended exactly as sampled (ids,
log-probs, per-token versions from the engine); the environment's text is
tokenised once (`ObservationEncoder`, producer/rollout/observation.py: through the
chat template where the tokenizer has one; a special token's text in it stays text,
producer/text_tokens.py) and appended with loss mask 0, log-prob 0 and the engine's
version at that moment. The next model turn is submitted as soon as the step
returns, with the whole token sequence as its prompt, so episodes at different
turns share the engine's continuous batching; nothing is ever decoded and
re-encoded. `EpisodeRunner._after_step` is where an episode completes a turn
(model turn, environment step, observation appended) and submits its next one.

Routing: rows are kept per trajectory (producer/rollout/trajectory.py).

Limits: `max_turns` model turns, `max_turn_tokens` per turn, and
`max_episode_tokens` response tokens (model and environment) per episode; the
limit that ends an episode names its end reason (`max_turns`, `max_tokens`).
The response always ends with a model turn (an observation that would be the
last thing appended is not appended).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlstream.common.config import EpisodeSettings
from rlstream.common.errors import ConfigError
from rlstream.common.record import DEFAULT_LIMITS, Rollout
from rlstream.common.tasks.environment import Environment, ModelTurn, StepResult
from rlstream.common.tasks.task import Task
from rlstream.producer import telemetry
from rlstream.producer.eviction import StaleEviction
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.journal.snapshot import episode_key
from rlstream.producer.rollout.driver import RolloutDriver
from rlstream.producer.rollout.observation import ObservationEncoder
from rlstream.producer.rollout.trajectory import Trajectory
from rlstream.producer.sample import FinishedSample, SamplingConfig
from rlstream.producer.text_tokens import RewrittenSpecialText, encode_text

END_REASONS = ("done", "max_turns", "max_tokens", "step_timeout", "env_error")
log = logging.getLogger("rlstream.producer")


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
        self._turns: dict[str, Trajectory] = {}  # request tag -> episode whose model turn is generating
        self._pending: dict[cf.Future, tuple[Trajectory, float, str]] = {}  # env call -> (episode, deadline, kind)
        self._ended: list[Trajectory] = []
        self._unrecorded: list[str] = []
        self._journaled: dict[str, int] = {}  # request tag -> its tokens at its last mid-turn journal write
        self._said_no_partial = False
        self.journal = None
        """producer/journal/ EpisodeJournal (build_driver sets it): every turn made durable (and,
        with its every_tokens, a turn still generating every N tokens: `_journal_long_turns`)."""
        self.active = 0
        """Episodes started and not ended."""

    def start(self, group_id: str, sample_idx: int, group_size: int, task: Task) -> None:
        ep = Trajectory(group_id, sample_idx, group_size, self._env_factory(), task)
        self.active += 1
        self._call(ep, "reset", ep.env.reset, task)

    def resume(self, ep: Trajectory) -> None:
        """A journaled episode continues here from its last durable turn (producer/journal/resume.py)."""
        self.active += 1
        self._submit(ep)

    def has_work(self) -> bool:
        return self.active > 0

    def owns(self, tag: Any) -> bool:
        return tag in self._turns

    def advance(self, finished: list[FinishedSample], wait_s: float = 0.0) -> list[Trajectory]:
        """Take the engine's finished turns, hand them to their environments, act on every
        environment answer (or deadline) so far, waiting up to `wait_s` for one; returns
        the episodes that ended (each with its `end`)."""
        for s in finished:
            ep = self._turns.pop(s.tag)
            self._journaled.pop(s.tag, None)
            ids = np.concatenate([ep.response_ids[ep.num_tokens - ep.partial_turn:], s.response_ids])
            ep.add_model_turn(s)  # a resumed partial turn's first tokens are in the trajectory already:
            ep.partial_turn = 0   # the environment sees the whole turn, once
            turn = ModelTurn(self.engine.decode(ids), tuple(ids.tolist()), str(s.finish_reason))
            if self.journal is not None:
                self.journal.on_model_turn(ep, turn)
            self._call(ep, "step", ep.env.step, turn)
        self._journal_long_turns()
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

    def oldest_versions(self) -> dict[str, int]:
        """Group id -> the oldest model-token version a record of its running episodes can
        carry (producer/eviction.py): the episode's own, or its generating turn's first token's."""
        in_engine = self.engine.oldest_versions()  # tag -> version
        out: dict[str, int] = {}
        for ep in self._running():
            versions = [v for v in (ep.oldest_model_version, in_engine.get(ep.tag)) if v is not None]
            if versions:
                out[ep.group_id] = min(min(versions), out.get(ep.group_id, min(versions)))
        return out

    def evict(self, group_id: str) -> int:
        """End the group's running episodes unpublished (stale eviction): their engine requests
        aborted, environment calls abandoned, journal entries tombstoned. Returns how many."""
        n = 0
        for ep in [ep for ep in self._running() if ep.group_id == group_id]:
            self._stop(ep)
            if self.journal is not None:
                self.journal.on_end(ep, recorded=False)
            n += 1
        return n

    def abandon(self, key: str) -> str | None:
        """Stop the running episode of journal key `key` (a peer took it over: producer/journal/),
        its journal entry left alone; returns its group id, None if it does not run here."""
        for ep in self._running():
            if episode_key(ep.group_id, ep.sample_idx) == key:
                self._stop(ep)
                return ep.group_id
        return None

    def _stop(self, ep: Trajectory) -> None:
        """End `ep` unpublished: its engine request aborted, its environment call abandoned."""
        if self._turns.pop(ep.tag, None) is not None:
            self.engine.abort_tag(ep.tag)
            self._journaled.pop(ep.tag, None)
        for fut in [f for f, (e, _, _) in self._pending.items() if e is ep]:
            fut.cancel()
            del self._pending[fut]
        self.active -= 1

    def _running(self) -> list[Trajectory]:
        return list(self._turns.values()) + [ep for ep, _, _ in self._pending.values()]

    def abort_all(self) -> int:
        """Forget every episode (the engine's requests are aborted by its own abort_all)."""
        n = self.active
        for fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._turns.clear()
        self._journaled.clear()
        self.active = 0
        return n

    def close(self) -> None:
        self.abort_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals

    def _call(self, ep: Trajectory, kind: str, fn: Callable, arg: Any) -> None:
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

    def _begin(self, ep: Trajectory, observation: Any) -> None:
        if not isinstance(observation, str) or not observation:
            self._end(ep, "env_error", f"reset returned {type(observation).__name__}, not a non-empty text")
            return
        ep.prompt_ids = self.engine.encode(observation)
        self._submit(ep)

    def _after_step(self, ep: Trajectory, r: Any) -> None:
        if not isinstance(r, StepResult):
            self._end(ep, "env_error", f"step returned {type(r).__name__}, not a StepResult")
            return
        total = _reward_total(ep.reward, r.reward)
        if total is None:  # the record would be refused at publication (common/record/schema.py's bound)
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
                ids = self.encode_observation(r.observation, ep.last_token)
            except RewrittenSpecialText as e:
                self._end(ep, "env_error", f"observation: {e}"[:200])
                return
            if ep.num_tokens + len(ids) + 1 > self._room(ep):
                self._end(ep, "max_tokens")
                return
            ep.add_observation(ids, self.engine.version)
            self._submit(ep)

    def _room(self, ep: Trajectory) -> int:
        """Response tokens the episode may hold in all (its limit and the engine's context)."""
        return min(self.settings.max_episode_tokens,
                   self.engine.settings.max_model_len - len(ep.prompt_ids))

    def _journal_long_turns(self) -> None:
        """producer.journal.every_tokens: each turn still generating is journaled (its tokens
        so far included) each time it has made another N tokens since its last write. Here,
        on the engine's thread after a step: a write per N tokens per episode, not per step."""
        every = self.journal.settings.every_tokens if self.journal is not None else None
        if not every:
            return
        if not self.engine.partial_routing:  # native routing: no rows until the turn ends
            if not self._said_no_partial:
                self._said_no_partial = True
                log.warning("producer.journal.every_tokens is off with routing native (vLLM returns a "
                            "request's routing rows only when it ends): turns are journaled between turns")
            return
        for tag, ep in self._turns.items():
            made = self.engine.generated(tag)
            if made - self._journaled.get(tag, 0) >= every and (so_far := self.engine.partial(tag)) is not None:
                self._journaled[tag] = made
                self.journal.on_turn(ep.with_partial_turn(so_far))

    def _submit(self, ep: Trajectory) -> None:
        # a resumed partial turn continues with what is left of its budget
        budget = min(self.settings.max_turn_tokens - ep.partial_turn, self._room(ep) - ep.num_tokens)
        if budget < 1:
            self._end(ep, "max_tokens")
            return
        if self.journal is not None:
            self.journal.on_turn(ep)
        ids = np.concatenate([ep.prompt_ids, ep.response_ids])
        self.engine.submit_group(ids, n=1, sampling=dataclasses.replace(self.sampling, max_tokens=budget),
                                 tag=ep.tag)
        self._turns[ep.tag] = ep

    def _end(self, ep: Trajectory, end: str, error: str | None = None) -> None:
        telemetry.EPISODES.labels(end=end).inc()
        self.active -= 1
        if error is not None:
            ep.info["error"] = error
        if self.journal is not None:
            self.journal.on_end(ep, recorded=bool(ep.num_tokens))
        if not ep.num_tokens:  # ended before its first model turn: no record can be made (its
            self._unrecorded.append(ep.group_id)  # group is timed out by the consumer, like an
            return                                # aborted sample; the producer releases its slot)
        ep.end = end
        self._ended.append(ep)


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


class Episodes(RolloutDriver):
    """The rollout driver of multi-turn episodes: G episodes per admitted task, their
    records published as they end (producer/rollout/driver.py)."""

    def __init__(self, runner: EpisodeRunner, groups: InFlightGroups, producer_id: str, resumer=None):
        self.runner, self.groups, self.producer_id = runner, groups, producer_id
        self.resumer = resumer
        """producer/journal/ Resumer (with producer.journal): orphaned episodes continue here."""
        self._staleness = (0, 0)  # (trainer version, max_staleness) of the service's last evict_stale
        self.eviction = StaleEviction()

    def start(self, group_id: str, task: Task, G: int) -> None:
        for i in range(G):
            self.runner.start(group_id, i, G, task)

    def on_finished(self, samples: list[FinishedSample]) -> list[Rollout]:
        """Hand the finished turns to their episodes; without any, wait briefly for an environment."""
        if self.resumer is not None:  # a dead producer's episodes (or this one's last run's) that fall to us
            self.resumer.tick(*self._staleness)
        records = []
        for ep in self.runner.advance(samples, wait_s=0.0 if samples else 0.02):
            task = self.groups.finish_sample(ep.group_id).task
            record = ep.to_rollout(self.producer_id, self.runner.sampling, prompt_text=task.prompt)
            if self.runner.journal is not None:  # None: a peer took the episode over (fenced, counted)
                record = self.runner.journal.stamp(record)
            if record is not None:
                records.append(record)
        for gid in self.runner.take_unrecorded():  # ended before a model turn: nothing to publish
            self.groups.finish_sample(gid)
        return records

    def has_work(self) -> bool:
        return self.runner.has_work()

    def evict_stale(self, trainer_version: int, max_staleness: int) -> None:
        """A group the consumer's gate will drop (its stalest episode's oldest model token is
        beyond the bound: producer/eviction.py) ends here, unpublished, its slot free. The
        bound also decides which orphans are too stale to resume (producer/journal/resume.py)."""
        self._staleness = (trainer_version, max_staleness)
        self.eviction.run(trainer_version, max_staleness, self.runner.oldest_versions, self.runner.evict, self.groups)

    def on_delivered(self, fut) -> None:
        if self.runner.journal is not None:  # acknowledged: the episode's journal entry goes
            self.runner.journal.on_delivered(fut)

    def abort(self) -> int:
        return self.runner.abort_all()  # their journal entries stay: resumed by the next owner

    def close(self) -> None:
        self.runner.close()
        if self.runner.journal is not None:
            self.runner.journal.close()
