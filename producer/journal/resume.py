"""Resume a claimed episode from its last durable turn.

    0. before it is claimed, refuse an entry whose record the schema would refuse
       (snapshot.py `validate`, under `engine_limits`: token ids in this model's
       vocabulary, lengths within the record's limits and this engine's context, finite
       log-probs, ids of at most 256 characters, routing of this model's shape): counted
       `outcome="invalid"` and by reason in `rlstream_producer_journal_refused_total`,
       copied to the DLQ, tombstoned;
    1. refuse what cannot finish: an environment that does not declare `resumable`, a
       prompt with its own scorer (not journaled), an episode already too stale to be
       trained (common/staleness.py): tombstoned, counted `rlstream_producer_resumed_episodes_total{outcome}`;
    2. rebuild the environment: a fresh one, reset with the task, then stepped with the
       journaled model turns in order (a resumable environment is deterministic in
       them; the calculator is); the answers are discarded, the journaled tokens stand;
    3. rebuild the episode's state (tokens, log-probs, mask, versions, routing rows) as
       journaled and hand it to the runner, which submits its next turn with the whole
       history as the prompt (prefilled, then sampling continues). An entry written mid-turn
       (`Snapshot.partial`) ends with that turn's tokens so far: the runner continues the same
       turn, and the environment, replayed without it, sees it whole once it ends.
The record is then built as for any episode; its first tokens are the journaled ones.
Each pass also abandons the episodes running here that a peer took over (journal.py
`taken_over`: this producer's lease had lapsed); their group slots are freed.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlstream.common.record import DEFAULT_LIMITS, RecordLimits
from rlstream.common.staleness import is_stale, staleness_of
from rlstream.producer import telemetry
from rlstream.producer.groups import GroupInfo
from rlstream.producer.journal.snapshot import JournalError, Snapshot, validate
from rlstream.common.tasks.environment import ModelTurn
from rlstream.common.tasks.task import Task
from rlstream.producer.rollout.trajectory import Trajectory, _add_run

log = logging.getLogger("rlstream.producer.journal")


@dataclass(frozen=True)
class StalenessView:
    trainer_version: int
    max_staleness: int


def engine_limits(engine) -> RecordLimits:
    """What a resumed episode's record must meet on `engine`: the record schema's limits
    with this model's vocabulary and MoE routing shape (from its config.json) and the
    engine's context (`max_model_len`), as the consumer's limits add the model's."""
    path = Path(getattr(engine, "model_dir", "") or "", "config.json")
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    experts = int(getattr(engine, "num_experts", 0) or 0)
    every_layer_moe = not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1
    settings = getattr(engine, "settings", None)
    return RecordLimits(
        max_token_id=int(cfg.get("vocab_size", DEFAULT_LIMITS.max_token_id + 1)) - 1,
        model_layers=cfg.get("num_hidden_layers") if experts and every_layer_moe else None,
        model_top_k=cfg.get("num_experts_per_tok") if experts else None, model_experts=experts or None,
        max_sequence_tokens=getattr(settings, "max_model_len", None))


def refusal(s: Snapshot, env, view: StalenessView) -> str | None:
    """Why `s` is not resumed ("not_resumable", "stale"), or None."""
    if s.own_score or not getattr(env, "resumable", False):
        return "not_resumable"
    oldest = s.oldest_version
    if oldest is not None and is_stale(staleness_of(view.trainer_version, oldest), view.max_staleness):
        return "stale"
    return None


def rebuild(s: Snapshot, env, task: Task) -> Trajectory:
    """The episode as it was after its last durable turn, its environment replayed."""
    env.reset(task)
    for t in s.model_turns:
        env.step(ModelTurn(t.text, tuple(t.token_ids), t.finish_reason))
    ep = Trajectory(s.group_id, s.sample_idx, s.group_size, env=env, task=task, prompt_ids=s.prompt_ids,
                    routing=s.routing, num_experts=s.num_experts, turns=s.turns, reward=s.reward, info=dict(s.info),
                    partial_turn=s.partial)
    cuts = np.flatnonzero(np.diff(s.mask.astype(np.int8))) + 1  # model turns and observations, as appended
    for ids, logprobs, model in zip(np.split(s.response, cuts), np.split(s.logprobs, cuts), np.split(s.mask, cuts)):
        if ids.size:
            ep._append(ids, logprobs, bool(model[0]))
    for version in s.versions.tolist():
        _add_run(ep._versions, int(version), 1)
    return ep


class Resumer:
    """Claims orphaned episodes from the journal into this producer's runner and groups."""

    def __init__(self, journal, runner, groups, env_factory: Callable[[], object], verify):
        self.journal, self.runner, self.groups = journal, runner, groups
        self.env_factory, self.verify = env_factory, verify
        self.limits = engine_limits(runner.engine)
        self._groups: dict[str, GroupInfo] = {}  # resumed groups' infos (shared with `groups`)

    def tick(self, trainer_version: int, max_staleness: int) -> int:
        """Resume what this producer claims and wins now; returns how many episodes it resumed.
        An episode whose record its dead holder already published is not resumed (counted
        `published`): only its journal entry was left behind."""
        n, view = 0, StalenessView(trainer_version, max_staleness)
        orphans = [s for s in self.journal.claim() if self.valid(s)]
        for key in self.journal.taken_over():
            group_id = self.runner.abandon(key)
            if group_id is not None:
                self.journal.fenced(key)
                if self.groups.get(group_id) is not None:
                    self.groups.finish_sample(group_id)
        won = self.journal.take(orphans) + self.journal.confirmed()
        done = self.journal.published(won)
        for s in won:
            if s.rollout_id in done:
                telemetry.RESUMED.labels(outcome="published").inc()
                log.info("episode %s (of %s) was published before its holder died: not resumed", s.key, s.owner)
                self.journal.drop(s)
                continue
            n += self.resume(s, view)
        return n

    def valid(self, s: Snapshot) -> bool:
        """Whether orphan `s` may be claimed: one whose record the schema would refuse is
        refused before it is claimed (counted, copied to the DLQ, tombstoned)."""
        try:
            validate(s, self.limits)
        except JournalError as e:
            telemetry.RESUMED.labels(outcome="invalid").inc()
            self.journal.refuse(s, e)
            return False
        return True

    def resume(self, s: Snapshot, view: StalenessView) -> bool:
        env = self.env_factory()
        why = refusal(s, env, view)
        if why is None:
            task = Task.checked_by(self.verify, s.prompt_text, s.answer)
            try:
                ep = rebuild(s, env, task)
            except Exception as e:  # noqa: BLE001 - an environment that cannot replay is not resumable
                log.warning("episode %s: replay failed (%s: %s)", s.key, type(e).__name__, e)
                why = "not_resumable"
        telemetry.RESUMED.labels(outcome=why or "resumed").inc()
        if why is not None:
            log.info("episode %s (of %s) not resumed: %s", s.key, s.owner, why)
            self.journal.drop(s)
            return False
        self.journal.adopt(s)
        self._add_to_group(s, ep.task)
        telemetry.RESUMED_TOKENS.inc(int(s.response.size))
        log.info("resuming episode %s of %s after %d turns (%d tokens)", s.key, s.owner, s.turns, s.response.size)
        self.runner.resume(ep)
        return True

    def _add_to_group(self, s: Snapshot, task: Task) -> None:
        """The group counts one more sample in flight here (it takes an admission slot)."""
        info = self._groups.get(s.group_id)
        if info is not None and info.remaining > 0 and self.groups.get(s.group_id) is info:  # (not evicted)
            info.remaining += 1
            return
        info = self._groups[s.group_id] = GroupInfo(task, 1)
        self.groups.add(s.group_id, info)
