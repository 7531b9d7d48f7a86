"""`EpisodeJournal`: what the episode runner and the Episodes driver call, in one object.

Per episode this process runs:

    on_model_turn(ep, turn)   the runner took a model turn (kept for the replay)
    on_turn(ep)               the episode is about to submit its next turn: its state is durable now
                              (or, every_tokens, `ep` has a turn so far: Trajectory.with_partial_turn)
    on_end(ep, recorded)      the episode ended; without a record it is forgotten (tombstone) at once
    stamp(record)             its record carries the episode's owner and fixed rollout id
    on_delivered(future)      the broker acknowledged the record: tombstone its entry

and per loop iteration `claim()` returns the orphaned snapshots this process would resume
(claims.py), decoded; `take()` claims them in the journal and keeps those this process
won; `published()` names those whose record a dead holder already published (the
Resumer, resume.py, runs the three). A lease thread renews `lease:<producer_id>` every
lease_s / 4, so a loop busy in a long weight update is not taken for dead; a SIGKILLed process stops
renewing and its episodes are claimed lease_s later.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from common.config import JournalSettings
from common.record import Rollout
from producer import telemetry
from producer.journal import claims
from producer.journal.snapshot import ModelTurnLog, Snapshot, episode_key
from producer.journal.topic import JournalTopic

log = logging.getLogger("rlstream.producer.journal")


class EpisodeJournal:
    def __init__(self, topic: JournalTopic, producer_id: str, settings: JournalSettings, clock=time.time,
                 own_score: bool = False, rollout_ends: Callable[[], dict[int, int]] = dict,
                 published: Callable[[dict[str, dict[int, int]]], set[str]] = lambda wanted: set()):
        self.topic, self.producer_id, self.settings, self.clock = topic, producer_id, settings, clock
        self.own_score = own_score
        """The prompts carry their own scorer (reasoning-gym `reward: dataset`), not serialisable:
        their episodes are journaled (a peer sees them) but not resumed."""
        self.rollout_ends = rollout_ends
        """The rollouts topic's end offsets, a lower bound (producer/admission.py `TopicEnds.current`)."""
        self._published = published
        """published.py `published`, bound to the Kafka settings."""
        self.incarnation = uuid.uuid4().hex[:12]
        self._ids: dict[str, tuple[str, str]] = {}  # key -> (owner, rollout_id) of episodes run here
        self._turns: dict[str, list[ModelTurnLog]] = {}
        self._awaiting: dict[str, str] = {}  # rollout_id -> key, published and not yet acknowledged
        # keys of episodes that ended here, until their tombstone is read back: the journal may
        # still show an older entry of theirs (a dead peer's), which must not be claimed again
        self._ended: set[str] = set()
        self._lock = threading.Lock()  # _awaiting: the publisher's thread acknowledges
        self._next_claim = 0.0
        self._stop = threading.Event()
        self._lease_thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Announce this process (lease, renewed from now on), then read the journal to its end
        (the renewals start first: reading a long journal takes seconds, and a peer must not
        take this process's first episodes for orphans meanwhile)."""
        first = self.topic.renew_lease(self.producer_id, self.incarnation)
        self._lease_thread = threading.Thread(target=self._renew, name="rlstream-journal-lease", daemon=True)
        self._lease_thread.start()
        self.topic.read_past([first], timeout_s=120)

    def _renew(self) -> None:
        while not self._stop.wait(self.settings.lease_s / 4):
            try:
                self.topic.renew_lease(self.producer_id, self.incarnation)
            except Exception as e:  # noqa: BLE001 - a broker outage: peers may claim; retried next period
                log.warning("journal lease not renewed: %s", e)

    def close(self) -> None:
        self._stop.set()
        if self._lease_thread is not None:
            self._lease_thread.join(timeout=5)
        self.topic.close()

    # ------------------------------------------------------- runner's hooks

    def on_model_turn(self, ep, turn) -> None:
        key = episode_key(ep.group_id, ep.sample_idx)
        self._turns.setdefault(key, []).append(ModelTurnLog(turn.text, list(turn.token_ids), turn.finish_reason))

    def on_turn(self, ep) -> None:
        key = episode_key(ep.group_id, ep.sample_idx)
        if key not in self._ids:
            self._ids[key] = (self.producer_id, Rollout.new_id())
        owner, rid = self._ids[key]
        runs = ep.version_runs
        self.topic.put(Snapshot(
            group_id=ep.group_id, sample_idx=ep.sample_idx, group_size=ep.group_size, owner=owner,
            holder=self.producer_id, incarnation=self.incarnation, rollout_id=rid, written_at=self.clock(),
            prompt_text=ep.task.prompt, answer=ep.task.reference, own_score=self.own_score,
            prompt_ids=np.asarray(ep.prompt_ids, dtype=np.int32), response=ep.response_ids, mask=ep.loss_mask,
            logprobs=ep.logprobs, versions=np.repeat(runs[:, 0], runs[:, 1]), routing=ep.routing,
            num_experts=ep.num_experts, turns=ep.turns, reward=float(ep.reward), info=dict(ep.info),
            model_turns=self._turns.get(key, []), rollout_ends=self.rollout_ends(), partial=ep.partial_turn))

    def on_end(self, ep, recorded: bool) -> None:
        key = episode_key(ep.group_id, ep.sample_idx)
        self._turns.pop(key, None)
        if not recorded and self._ids.pop(key, None) is not None:
            self._ended.add(key)
            self.topic.tombstone(key)

    # ------------------------------------------------------ service's hooks

    def stamp(self, record: Rollout) -> Rollout:
        """The record of an ended episode: its owner's producer id and the episode's rollout id."""
        key = episode_key(record.group_id, record.sample_idx)
        ids = self._ids.pop(key, None)
        if ids is not None:
            self._ended.add(key)
            record.producer_id, record.rollout_id = ids
            with self._lock:
                self._awaiting[record.rollout_id] = key
        return record

    def on_delivered(self, fut) -> None:
        """The publisher's thread: a record is acknowledged, its episode's entry goes."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            key = self._awaiting.pop(getattr(fut, "rollout_id", None) or "", None)
        if key is not None:
            self.topic.tombstone(key)

    # ----------------------------------------------------------- claiming

    def claim(self) -> list[Snapshot]:
        """Orphaned episodes this process now resumes (checked every lease_s / 4)."""
        now = self.clock()
        if now < self._next_claim:
            return []
        self._next_claim = now + self.settings.lease_s / 4
        self.topic.poll()
        self._ended &= self.topic.entries.keys()  # tombstones read back: forgotten
        # leases are judged at the journal's time as read so far, not the wall clock: a reader
        # behind the topic sees old leases of live peers (the bench's first runs resumed live
        # episodes that way), and every live producer renews within lease_s / 4 of what it read
        seen = min(now, self.topic.newest_at)
        leases = dict(self.topic.leases)
        leases[self.producer_id] = claims.Lease(self.producer_id, self.incarnation, seen)  # we are alive
        entries = [e for e in self.topic.entries.values() if e.key not in self._ids and e.key not in self._ended]
        keys = claims.claims_for(self.producer_id, entries, leases, seen, self.settings.lease_s)
        keys += [e.key for e in entries if (e.holder, e.incarnation) == (self.producer_id, self.incarnation)]
        snaps = [self.topic.decoded(k) for k in keys]  # (the last keys: claimed here, not yet resumed)
        return [s for s in snaps if s is not None]

    def take(self, orphans: list[Snapshot]) -> list[Snapshot]:
        """Claim `orphans` in the journal; returns those this process won. Each claim names the
        entry it takes over, every reader applies only the first claim of an entry
        (claims.py `applies`), and this process reads the journal past its own claims before
        it answers: two producers whose views of the leases differ never both resume one."""
        if not orphans:
            return []
        now, writes = self.clock(), []
        for s in orphans:  # the claim keeps the holder's rollout_ends: published() looks from there
            token = claims.Held(s.key, s.holder, s.incarnation, s.written_at).token
            writes.append(self.topic.put(dataclasses.replace(s, holder=self.producer_id, incarnation=self.incarnation,
                                                             written_at=now, claimed_from=token)))
        try:
            self.topic.read_past(writes)
        except Exception as e:  # noqa: BLE001 - a broker outage: claims that did apply are ours
            log.warning("journal claims not read back (%s: %s); retried at the next claim", type(e).__name__, e)
            return []  # (`claim` returns entries this process holds and does not run)
        won = [s for s in orphans if self._holds(s.key)]
        if lost := len(orphans) - len(won):
            telemetry.RESUMED.labels(outcome="claimed_by_peer").inc(lost)
            log.info("%d orphaned episodes were claimed by a peer first", lost)
        return won

    def _holds(self, key: str) -> bool:
        e = self.topic.entries.get(key)
        return e is not None and (e.holder, e.incarnation) == (self.producer_id, self.incarnation)

    def published(self, won: list[Snapshot]) -> set[str]:
        """Rollout ids of `won` whose record is already in the rollouts topic (published.py)."""
        return self._published({s.rollout_id: s.rollout_ends for s in won}) if won else set()

    def adopt(self, s: Snapshot) -> None:
        """`s` is resumed here: its record keeps its owner and rollout id, its turns their log."""
        self._ids[s.key] = (s.owner, s.rollout_id)
        self._turns[s.key] = list(s.model_turns)

    def drop(self, s: Snapshot) -> None:
        """`s` will not be resumed (counted by the caller): its entry goes."""
        self.topic.tombstone(s.key)
        self.topic.entries.pop(s.key, None)
        self.topic.snapshots.pop(s.key, None)
