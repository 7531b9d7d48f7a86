"""`EpisodeJournal`: what the episode runner and the Episodes driver call, in one object.

Per episode this process runs:

    on_model_turn(ep, turn)   the runner took a model turn (kept for the replay)
    on_turn(ep)               the episode is about to submit its next turn: its state is durable now
                              (or, every_tokens, `ep` has a turn so far: Trajectory.with_partial_turn)
    on_end(ep, recorded)      the episode ended; without a record it is forgotten (tombstone) at once
    stamp(record)             its record carries the episode's owner, fixed rollout id and claim
                              epoch; None if a peer took the episode over (fenced: not published)
    on_delivered(future)      the broker acknowledged the record: its entry is tombstoned (at the
                              next claim pass, on the service's thread, unless a peer holds it now)

and per loop iteration `claim()` returns the orphaned snapshots this process would resume
(claims.py), decoded; `take()` claims them in the journal and keeps those this process
won (`confirmed()` adds claims that applied while their read-back failed); `published()`
names those whose record a dead holder already published; `taken_over()` names the
episodes running here that a peer claimed (this process's lease lapsed in the journal:
they end here unpublished, counted). The Resumer (resume.py) runs them. A lease thread
renews `lease:<producer_id>` every lease_s / 4, so a loop busy in a long weight update is
not taken for dead; a SIGKILLed process stops renewing and its episodes are claimed lease_s later.

Every episode held here ends one way, once: its record published (then tombstoned), ended
without a record (tombstoned), taken over by a peer (fenced, counted), refused or dropped at
resume (resume.py, counted), or its delivery failed for good (tombstoned; the publisher
counts it). Keys of episodes that ended here are kept until their tombstone is read back,
so an older entry of theirs is never claimed again; a claim that loses is not retried for
lease_s. The same pass copies refused journal records to the DLQ and, on one live producer,
writes a checkpoint of the journal's live state (checkpoint.py).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rlstream.common.config import JournalSettings
from rlstream.common.record import Rollout
from rlstream.producer import telemetry
from rlstream.producer.journal import claims
from rlstream.producer.journal.snapshot import JournalError, ModelTurnLog, Snapshot, episode_key
from rlstream.producer.journal.topic import JournalTopic

log = logging.getLogger("rlstream.producer.journal")


@dataclass(frozen=True)
class Running:
    """An episode this process holds: its record's owner and rollout id, and the claim epoch."""

    owner: str
    rollout_id: str
    epoch: int = 0
    resumed_from: str = ""


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
        self._ids: dict[str, Running] = {}  # key -> episodes run here
        self._turns: dict[str, list[ModelTurnLog]] = {}
        self._awaiting: dict[str, str] = {}  # rollout_id -> key, published and not yet acknowledged
        self._acked: list[str] = []  # keys whose record the broker acknowledged: tombstoned at the next pass
        self._ended: dict[str, int] = {}  # keys that ended here -> their epoch, until their tombstone is read back
        self._unconfirmed: dict[str, Snapshot] = {}  # claims written whose read-back failed
        self._retry_at: dict[str, float] = {}  # key -> when a lost claim of it may be tried again
        self._taken: list[str] = []  # running here, claimed by a peer, as of the last pass: `taken_over`
        self._lock = threading.Lock()  # _awaiting, _acked: the publisher's thread acknowledges
        self._next_claim = 0.0
        self._stop = threading.Event()
        self._lease_thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Announce this process (lease, renewed from now on), then read the journal to its end
        from its newest checkpoint (the renewals start first: reading a long journal takes
        seconds, and a peer must not take this process's first episodes for orphans meanwhile)."""
        first = self.topic.renew_lease(self.producer_id, self.incarnation)
        self._lease_thread = threading.Thread(target=self._renew, name="rlstream-journal-lease", daemon=True)
        self._lease_thread.start()
        self.topic.start([first], timeout_s=120)

    def _renew(self) -> None:
        while not self._stop.wait(self.settings.lease_s / 4):
            try:
                self.topic.renew_lease(self.producer_id, self.incarnation)
            except Exception as e:  # noqa: BLE001 - a broker outage: peers may claim; retried next period
                log.warning("journal lease not renewed: %s", e)

    def close(self) -> None:
        """Stop renewing; the entries of acknowledged records go first (a drained shutdown
        leaves only what it aborted: resumed by the next owner)."""
        self._stop.set()
        if self._lease_thread is not None:
            self._lease_thread.join(timeout=5)
        try:
            self._tombstone_acked()
            self.topic.flush()
        except Exception as e:  # noqa: BLE001 - a broker outage: the next owner finds them published
            log.warning("journal tombstones not written at close: %s", e)
        self.topic.close()

    # ------------------------------------------------------- runner's hooks

    def on_model_turn(self, ep, turn) -> None:
        key = episode_key(ep.group_id, ep.sample_idx)
        self._turns.setdefault(key, []).append(ModelTurnLog(turn.text, list(turn.token_ids), turn.finish_reason))

    def on_turn(self, ep) -> None:
        key = episode_key(ep.group_id, ep.sample_idx)
        run = self._ids.setdefault(key, Running(self.producer_id, Rollout.new_id()))
        runs = ep.version_runs
        self.topic.put(Snapshot(
            group_id=ep.group_id, sample_idx=ep.sample_idx, group_size=ep.group_size, owner=run.owner,
            holder=self.producer_id, incarnation=self.incarnation, rollout_id=run.rollout_id,
            written_at=self.clock(), prompt_text=ep.task.prompt, answer=ep.task.reference, own_score=self.own_score,
            prompt_ids=np.asarray(ep.prompt_ids, dtype=np.int32), response=ep.response_ids, mask=ep.loss_mask,
            logprobs=ep.logprobs, versions=np.repeat(runs[:, 0], runs[:, 1]), routing=ep.routing,
            num_experts=ep.num_experts, turns=ep.turns, reward=float(ep.reward), info=dict(ep.info),
            model_turns=self._turns.get(key, []), rollout_ends=self.rollout_ends(), partial=ep.partial_turn,
            epoch=run.epoch, resumed_from=run.resumed_from))

    def on_end(self, ep, recorded: bool) -> None:
        key = episode_key(ep.group_id, ep.sample_idx)
        self._turns.pop(key, None)
        run = self._ids.pop(key, None) if not recorded else None
        if run is not None:
            self._ended[key] = run.epoch
            if not self._taken_by_peer(key, run.epoch):
                self.topic.tombstone(key)

    # ------------------------------------------------------ service's hooks

    def stamp(self, record: Rollout) -> Rollout | None:
        """The record of an ended episode: its owner's producer id, the episode's rollout id and
        claim epoch. None if a peer took the episode over (counted): its copy is the peer's."""
        key = episode_key(record.group_id, record.sample_idx)
        run = self._ids.pop(key, None)
        if run is None:
            return record
        if self._taken_by_peer(key, run.epoch):
            self._fenced(key, "ended")
            return None
        self._ended[key] = run.epoch
        record.producer_id, record.rollout_id, record.claim_epoch = run.owner, run.rollout_id, run.epoch
        with self._lock:
            self._awaiting[record.rollout_id] = key
        return record

    def on_delivered(self, fut) -> None:
        """The publisher's thread: a record is acknowledged (or failed for good: the publisher
        counts it), its episode's entry goes at the next claim pass."""
        if fut.cancelled():
            return
        if fut.exception() is not None:
            log.warning("record %s not delivered (%s): its journal entry goes with it",
                        getattr(fut, "rollout_id", "?"), fut.exception())
        with self._lock:
            key = self._awaiting.pop(getattr(fut, "rollout_id", None) or "", None)
            if key is not None:
                self._acked.append(key)

    # ----------------------------------------------------------- claiming

    def claim(self) -> list[Snapshot]:
        """Orphaned episodes this process now resumes (checked every lease_s / 4), decoded;
        the same pass settles this process's own ended episodes (`_settle`)."""
        now = self.clock()
        if now < self._next_claim:
            return []
        self._next_claim = now + self.settings.lease_s / 4
        self.topic.poll()
        self._settle()
        # leases are judged at the journal's time as read so far, not the wall clock: a reader
        # behind the topic sees old leases of live peers (the bench's first runs resumed live
        # episodes that way), and every live producer renews within lease_s / 4 of what it read
        seen = min(now, self.topic.newest_at)
        leases = dict(self.topic.leases)
        leases[self.producer_id] = claims.Lease(self.producer_id, self.incarnation, seen)  # we are alive
        live = claims.live_producers(leases, seen, self.settings.lease_s)
        self._dead_letters(live)
        if self.topic.checkpoint_due(self.settings.checkpoint_every) and claims.claimant("checkpoint", live) ==\
                self.producer_id:
            self.topic.write_checkpoint()
        skip = self._ids.keys() | self._ended.keys() | self._unconfirmed.keys()
        entries = [e for e in self.topic.entries.values() if e.key not in skip and self._retry_at.get(e.key, 0) <= now]
        out = []
        for key in claims.claims_for(self.producer_id, entries, leases, seen, self.settings.lease_s):
            s = self.topic.decoded(key)
            if s is None:  # refused (counted, queued as a dead letter): an orphan no one can resume
                self.topic.tombstone(key)
            else:
                out.append(s)
        return out

    def _settle(self) -> None:
        """Tombstone the entries of acknowledged records, forget the ended keys whose tombstone
        came back, and note the running episodes a peer claimed (`taken_over`)."""
        self._tombstone_acked()
        gone = self.topic.take_tombstoned()
        self._ended = {k: epoch for k, epoch in self._ended.items() if k not in gone and not self._taken_by_peer(k, epoch)}
        self._taken = [key for key, run in self._ids.items() if self._taken_by_peer(key, run.epoch)]

    def _tombstone_acked(self) -> None:
        with self._lock:
            acked, self._acked = self._acked, []
        for key in acked:
            if not self._taken_by_peer(key, self._ended.get(key, -1)):
                self.topic.tombstone(key)

    def _taken_by_peer(self, key: str, epoch: int = -1) -> bool:
        """Whether the journal, as read here, shows `key` held by another process (at a newer
        epoch than `epoch`, when given)."""
        e = self.topic.entries.get(key)
        return e is not None and (e.holder, e.incarnation) != (self.producer_id, self.incarnation) and e.epoch > epoch

    def _fenced(self, key: str, at: str) -> None:
        """Episode `key`, run here, was taken over: counted, with the generation time spent on
        it since the entry the peer resumed from."""
        self._ids.pop(key, None)
        self._turns.pop(key, None)
        e = self.topic.entries[key]
        since = claims.token_time(e.resumed_from) if e.resumed_from.startswith(
            f"{self.producer_id}/{self.incarnation}/") else None
        wasted = max(0.0, self.clock() - since) if since is not None else 0.0
        telemetry.EPISODES_FENCED.labels(at=at).inc()
        telemetry.FENCED_SECONDS.inc(wasted)
        log.warning("episode %s was taken over by %s (epoch %d) while this producer's lease had lapsed: ended here "
                    "unpublished (%.1f s of generation since the state it resumed from)", key, e.holder, e.epoch,
                    wasted)

    def taken_over(self) -> list[str]:
        """Keys of episodes running here that a peer claimed, as of the last claim pass: the
        runner abandons each, then `fenced(key)`."""
        out, self._taken = self._taken, []
        return out

    def fenced(self, key: str) -> None:
        """Episode `key`, taken over, was abandoned while it ran here: counted, forgotten."""
        if key in self._ids:
            self._fenced(key, "running")

    def _dead_letters(self, live: list[str]) -> None:
        """Copy refused journal records to the DLQ: those this process refused when it claimed
        them, and of those every reader refuses, the ones whose key this process would claim."""
        letters = [letter for letter in self.topic.take_letters() if letter.claimed or claims.claimant(
            (letter.key or b"").decode("utf-8", "replace"), live) == self.producer_id]
        self.topic.send_letters(letters)

    def take(self, orphans: list[Snapshot]) -> list[Snapshot]:
        """Claim `orphans` in the journal; returns those this process won, as claimed (this
        holder, the next epoch). Each claim names the entry it takes over, every reader
        applies only the first claim of an entry (claims.py `applies`), and this process reads
        the journal past its own claims before it answers: two producers whose views of the
        leases differ never both resume one."""
        if not orphans:
            return []
        now, writes, claimed = self.clock(), [], []
        for s in orphans:  # the claim keeps the holder's rollout_ends: published() looks from there
            token = claims.Held(s.key, s.holder, s.incarnation, s.written_at).token
            c = dataclasses.replace(s, holder=self.producer_id, incarnation=self.incarnation, written_at=now,
                                    claimed_from=token, epoch=s.epoch + 1)
            claimed.append(c)
            writes.append(self.topic.put(c))
        try:
            self.topic.read_past(writes)
        except Exception as e:  # noqa: BLE001 - a broker outage: claims that did apply are ours
            log.warning("journal claims not read back (%s: %s); confirmed at the next claim", type(e).__name__, e)
            self._unconfirmed.update((c.key, c) for c in claimed)
            return []
        won = [c for c in claimed if self._holds(c.key, c.epoch)]
        self._lost([c for c in claimed if not self._holds(c.key, c.epoch)], now)
        return won

    def confirmed(self) -> list[Snapshot]:
        """Claims whose read-back failed that the journal, read since, shows this process won."""
        if not self._unconfirmed:
            return []
        done, self._unconfirmed = self._unconfirmed, {}
        won = [c for c in done.values() if self._holds(c.key, c.epoch)]
        self._lost([c for c in done.values() if not self._holds(c.key, c.epoch)], self.clock())
        return won

    def _lost(self, claimed: list[Snapshot], now: float) -> None:
        for c in claimed:
            e = self.topic.entries.get(c.key)
            outcome = "claimed_by_peer" if e is not None and e.epoch >= c.epoch else "not_orphaned"
            telemetry.RESUMED.labels(outcome=outcome).inc()
            self._retry_at[c.key] = now + self.settings.lease_s
        if claimed:
            log.info("%d orphaned episodes not won: another producer claimed them first, or their holder renewed "
                     "its lease before the claim", len(claimed))
        self._retry_at = {k: t for k, t in self._retry_at.items() if t > now}

    def _holds(self, key: str, epoch: int) -> bool:
        e = self.topic.entries.get(key)
        return e is not None and (e.holder, e.incarnation, e.epoch) == (self.producer_id, self.incarnation, epoch)

    def published(self, won: list[Snapshot]) -> set[str]:
        """Rollout ids of `won` whose record is already in the rollouts topic (published.py)."""
        return self._published({s.rollout_id: s.rollout_ends for s in won}) if won else set()

    def adopt(self, s: Snapshot) -> None:
        """`s` (as claimed) is resumed here: its record keeps its owner, rollout id and the
        claim's epoch, its turns their log."""
        self._ids[s.key] = Running(s.owner, s.rollout_id, s.epoch, s.claimed_from)
        self._turns[s.key] = list(s.model_turns)

    def drop(self, s: Snapshot) -> None:
        """`s` will not be resumed (counted by the caller): its entry goes."""
        self.topic.tombstone(s.key)
        self.topic.forget(s.key)

    def refuse(self, s: Snapshot, e: JournalError) -> None:
        """`s`, claimed here, is refused (resume.py `validate`): counted, copied to the DLQ, tombstoned."""
        self.topic.refuse_entry(s.key, e)
        self.topic.tombstone(s.key)
