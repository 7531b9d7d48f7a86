"""One trajectory type, and the one conversion of a rollout into its record.

A `Trajectory` is one sample of a group as it grows: the prompt, then model
turns (tokens, log-probs and per-token versions exactly as the engine sampled
them, loss mask 1) and, in multi-turn episodes, environment tokens between
them (loss mask 0). A single-turn sample is a one-turn trajectory
(`Trajectory.of_sample`). `to_rollout` builds every record the producer
publishes (schema in common/record/):

- schema 1 when every response token is the model's (no `loss_mask`),
  schema 2 otherwise;
- log-probs are clamped to <= 0 (float rounding can give +1e-8 for a token
  of probability ~1; the record refuses positive log-probs);
- `token_versions` travels only when the versions change within the response
  (one run is implied by `policy_version`);
- `num_experts` is 0 when the sample carries no routing;
- `reward_info` keeps only scalar values (str, int, float, bool), plus the
  episode's `end` and `turns` when it is an episode;
- `finish_reason`: an episode's end reason mapped by `FINISH`; a single
  engine sample keeps the engine's (one the record does not know is "stop");
- `temperature` is the sampling temperature: the log-probs are those of
  softmax(logits / temperature), and the trainer evaluates pi_old at the same
  temperature (docs/trainer.md).

Routing: each turn's request computes rows for its whole prompt again (no
prefix cache). Row i of the record is taken from the first request that
computed it (the turn that sampled the token, or for environment positions the
next turn's prefill), so a model token's routing is the one it was sampled
with, also across a weight update between turns.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rlstream.common.record import FINISH_REASONS, Rollout
from rlstream.common.tasks.task import Task
from rlstream.producer.sample import FinishedSample, SamplingConfig

FINISH = {"done": "stop", "max_turns": "length", "max_tokens": "length",
          "step_timeout": "abort", "env_error": "abort",
          "reported": "stop", "verified": "stop"}  # the last two: black-box agents (producer/rollout/agents/driver.py)
"""Episode end -> the record's finish_reason."""


@dataclass
class Trajectory:
    group_id: str
    sample_idx: int
    group_size: int
    env: Any = None
    task: Task | None = None
    prompt_ids: np.ndarray | None = None
    routing: np.ndarray | None = None
    num_experts: int = 0
    turns: int = 0
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    end: str | None = None
    """How the episode ended (a key of FINISH); None: one engine sample, which keeps the engine's
    finish reason."""
    finish_reason: str = "stop"
    """The engine's finish reason of the last model turn."""
    policy_version: int | None = None
    """The record's policy_version: a single sample's dispatch version; None: the version of the
    first response token (an episode's)."""
    num_tokens: int = 0
    """Response tokens so far (model and environment)."""
    partial_turn: int = 0
    """The last `partial_turn` response tokens are a model turn still generating (journaled
    mid-turn, producer.journal.every_tokens): not counted in `turns`; a resumed episode
    continues that turn (producer/rollout/episodes.py)."""
    # the response as appended, one array per turn or observation (a single sample: one of
    # each, used as the engine returned it), and run-lengths: no per-token Python objects
    _ids: list[np.ndarray] = field(default_factory=list, repr=False)
    _logprobs: list[np.ndarray] = field(default_factory=list, repr=False)
    _versions: list[list[int]] = field(default_factory=list, repr=False)  # [[version, count]], merged
    _mask: list[list] = field(default_factory=list, repr=False)  # [[is_model, count]], merged

    @classmethod
    def of_sample(cls, s: FinishedSample) -> Trajectory:
        """A single-turn sample: one model turn after its prompt."""
        t = cls(s.tag, s.sample_idx, s.group_size, prompt_ids=s.prompt_ids, policy_version=s.dispatch_version)
        t.add_model_turn(s)
        return t

    @property
    def tag(self) -> str:
        """The engine tag of the trajectory's next model turn."""
        return f"{self.group_id}#{self.sample_idx}#t{self.turns}"

    @property
    def response_ids(self) -> np.ndarray:
        return _joined(self._ids, np.int32)

    @property
    def logprobs(self) -> np.ndarray:
        return _joined(self._logprobs, np.float32)

    @property
    def loss_mask(self) -> np.ndarray:
        return np.repeat([m for m, _ in self._mask], [n for _, n in self._mask]).astype(bool)

    @property
    def version_runs(self) -> np.ndarray:
        """Run-length [(version, count)] of the response tokens (int64 [R, 2])."""
        return np.asarray(self._versions, dtype=np.int64).reshape(-1, 2)

    @property
    def oldest_model_version(self) -> int | None:
        return oldest_model_version(np.repeat(self.version_runs[:, 0], self.version_runs[:, 1]), self.loss_mask)

    @property
    def last_token(self) -> int:
        return int(self._ids[-1][-1])

    def add_model_turn(self, s: FinishedSample) -> None:
        self._append(np.asarray(s.response_ids, dtype=np.int32), np.minimum(s.logprobs, 0.0), True)
        for version, count in s.token_versions:
            _add_run(self._versions, int(version), int(count))
        self.turns += 1
        self.finish_reason = str(s.finish_reason)
        if s.routed_experts is not None:  # rows 0 .. P+T-2 of this turn; keep the first computation
            have = 0 if self.routing is None else self.routing.shape[0]
            new = s.routed_experts[have:]
            self.routing = new if self.routing is None else np.concatenate([self.routing, new])
            self.num_experts = s.num_experts

    def with_partial_turn(self, s: FinishedSample) -> Trajectory:
        """A copy with `s`, a model turn so far (RolloutEngine.partial), appended as a partial
        turn: what the journal writes mid-turn. This trajectory is left as it was."""
        t = replace(self, info=dict(self.info), _ids=list(self._ids), _logprobs=list(self._logprobs),
                    _versions=[list(r) for r in self._versions], _mask=[list(r) for r in self._mask])
        t.add_model_turn(s)
        t.turns, t.finish_reason = self.turns, self.finish_reason  # the turn is not over
        t.partial_turn = self.partial_turn + int(s.response_ids.size)
        return t

    def add_observation(self, ids: list[int], version: int) -> None:
        self._append(np.asarray(ids, dtype=np.int32), np.zeros(len(ids), np.float32), False)
        _add_run(self._versions, int(version), len(ids))

    def _append(self, ids: np.ndarray, logprobs: np.ndarray, model: bool) -> None:
        if not ids.size:
            return
        self._ids.append(ids)
        self._logprobs.append(logprobs)
        _add_run(self._mask, model, int(ids.size))
        self.num_tokens += int(ids.size)

    def to_rollout(self, producer_id: str, sampling: SamplingConfig, prompt_text: str | None = None) -> Rollout:
        """The record of this trajectory (schema 2 when an environment token is in it, else schema 1)."""
        runs = self.version_runs
        version = self.policy_version if self.policy_version is not None else int(runs[0, 0])
        info = {k: v for k, v in self.info.items() if isinstance(v, (str, int, float, bool))}
        if self.end is not None:
            info.update(end=self.end, turns=self.turns)
            finish = FINISH[self.end]
        else:
            finish = self.finish_reason if self.finish_reason in FINISH_REASONS else "stop"
        all_model = all(model for model, _ in self._mask)
        return Rollout(
            rollout_id=Rollout.new_id(), group_id=self.group_id, sample_idx=self.sample_idx,
            group_size=self.group_size, prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=self.response_ids, logprobs=self.logprobs,
            policy_version=int(version), reward=float(self.reward), finish_reason=finish,
            producer_id=producer_id, prompt_text=prompt_text,
            token_versions=runs if len(runs) > 1 else None, routed_experts=self.routing,
            num_experts=self.num_experts if self.routing is not None else 0,
            reward_info=info, sampling_digest=sampling.digest, model_digest=f"v{int(version)}",
            temperature=float(sampling.temperature), loss_mask=None if all_model else self.loss_mask)


def oldest_model_version(versions: np.ndarray, mask: np.ndarray) -> int | None:
    """The oldest policy version of a model token (the staleness rule's, common/staleness.py)
    of per-token `versions` under the loss `mask`; None before the first model token."""
    model = versions[mask]
    return int(model.min()) if model.size else None


def _add_run(runs: list[list], value, count: int) -> None:
    """Append `count` x `value` to run-lengths `runs`, merging with the last run."""
    if count <= 0:
        return
    if runs and runs[-1][0] == value:
        runs[-1][1] += count
    else:
        runs.append([value, count])


def _joined(parts: list[np.ndarray], dtype) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]  # a single sample's: the engine's array, as the record took it before
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
