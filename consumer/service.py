"""The consumer service: read rollouts, gate by staleness, train, checkpoint, publish.

    rlstream consumer -c configs/tiny-cpu.yaml        (also: python -m rlstream consumer)

One global step per iteration of a loop of named steps:

    next_batch (apply_control at its start) -> train_step -> checkpoint (when due) -> publish_weights
    -> the `max_staleness: auto` controller (consumer/stability/auto.py) reads the step's signals

Runtime settings apply at the next batch boundary: every control change the
broker acknowledged before a batch gates its first group applies to that
whole batch (`apply_control` reads the control topic to its end there), also
on a consumer that sat idle waiting for data.

Exactly-once training: offsets are committed only inside a checkpoint, with
the model and version they produced; every consumed record ends in exactly
one outcome (the contract: consumer/stream/ledger.py). Checkpoints come on a cadence
(`consumer.checkpoint`, consumer/checkpoint/cadence.py) and at a clean stop; a crash
redoes the steps since the last one, re-reading their records, so each record
is trained once in the lineage of the final model (consumer/checkpoint/files.py).
Under torchrun this service is rank 0 and the other ranks follow it
(consumer/ranks/protocol.py).

Versions are never reused. A restart from a checkpoint older than the newest
version announced (or written to the weight store) by the incarnation that
died continues above it: the restored weights are announced under a new
version, so producers reload them; records keep their real version numbers.
`step` counts optimizer steps; `version` >= `step`. So that skipped versions
age no record, the gate counts staleness in steps (`GateClock`,
consumer/stream/gate.py): the renumbering is noted in the checkpoint directory
(each version maps to the step whose model it was), and the records the lost
steps trained are judged at the step they were first gated at (the audit log
since the checkpoint): the redone steps train them again, not drop them as stale.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import uuid

from rlstream.common.config import ControlSettings, RlstreamConfig
from rlstream.common.control.liveness import ProgressMonitor, Readiness
from rlstream.common.control.messages import ControlChange
from rlstream.common.control.plane import ControlFollower, ControlPlaneWriter
from rlstream.common.control.signing import signing_key
from rlstream.common.errors import ConfigError
from rlstream.common.kafka.broker import run_with_broker
from rlstream.common.kafka.claimcheck import BlobStore
from rlstream.common.kafka.client import ensure_topics
from rlstream.common.kafka.reader import RolloutReader
from rlstream.common.lifecycle import close_attrs
from rlstream.common.weights.backends import resolve
from rlstream.common.weights.store import WeightStore
from rlstream.consumer import telemetry
from rlstream.consumer.checkpoint.cadence import Cadence
from rlstream.consumer.logreplay.record import step_inputs
from rlstream.consumer.ranks.protocol import Leader, run_follower, start_rank
from rlstream.consumer.stability.auto import AutoStaleness
from rlstream.consumer.stream.assembler import GroupAssembler
from rlstream.consumer.stream.gate import (
    FILTER_WINDOW_BATCHES,
    FilteredShare,
    GateClock,
    ReadyGroup,
    gate_group,
)
from rlstream.consumer.stream.intake import IntakeWatch, VersionBound, record_limits
from rlstream.consumer.stream.ledger import Ledger
from rlstream.consumer.train.memory_check import check_config
from rlstream.consumer.train.parallel import launch_rank, launch_world_size
from rlstream.consumer.weights.announce import PolicyAnnouncer

log = logging.getLogger("rlstream.consumer")


class ConsumerService:
    def __init__(self, cfg: RlstreamConfig, bootstrap: str):
        self.cfg, self.ccfg = cfg, cfg.consumer
        self.kafka = cfg.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        self.control = ControlSettings.from_settings(cfg.staleness)
        self.step = self.version = 0
        self.ledger = Ledger(GroupAssembler(self.ccfg.group_size, self.ccfg.group_timeout_s), telemetry.count_outcome)
        self.filtered = FilteredShare(FILTER_WINDOW_BATCHES * self.ccfg.groups_per_batch)
        self.clock = GateClock()
        """Staleness in steps of the lineage, across crashes (`_restore`, `_continue_versions`)."""
        self.run_id = uuid.uuid4().hex[:12]
        self.lineage: list[list] = [[self.run_id, 0]]
        """[run id, step it started at] of every incarnation whose steps make the model (consumer/checkpoint/files.py)."""
        self._stop = False
        # live while a full batch waiting gets trained within the bound; ready once started
        self.liveness = ProgressMonitor(self.ccfg.liveness.stall_after_s)
        # ready while the broker answers and delivers what waits on it (consumer/stream/intake.py IntakeWatch)
        self.readiness = Readiness(self.kafka)
        self.intake = IntakeWatch(self.ccfg.liveness.intake_stall_after_s, self.kafka.topics.rollouts)
        self.readiness.add_check(self.intake.reasons)
        self.auto = AutoStaleness(cfg.staleness.auto, lambda *a: self._writer.set_control(*a))
        """`max_staleness: auto`: its controller, fed after every step (consumer/stability/)."""

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        trainer, ckpt, channel, latest = start_rank(self.cfg)  # collective under torchrun: every rank
        self.leader = Leader(trainer, ckpt, self.ccfg.group_size, channel)
        ensure_topics(self.kafka)
        offsets = self._restore(latest)
        self.cadence = Cadence(self.ccfg.checkpoint, self.step)
        key = signing_key(self.ccfg.http.admin_token)  # control records: signed and verified with it
        self.follower = ControlFollower(self.kafka, self.control, key)
        self.follower.catch_up()  # settings and the newest announcement, before any record is read
        self.control = self.follower.view.state
        self.reader = self._open_reader(offsets)
        self._writer = ControlPlaneWriter(self.kafka, key)
        self.announcer = PolicyAnnouncer(self._writer, WeightStore(self.ccfg.weight_store_dir, self.ccfg.keep_versions),
                                         self.cfg.model.path, self.ccfg.groups_per_batch, self.ccfg.group_size,
                                         self.ccfg.weights, _weight_backend(self.ccfg.weights.backend))
        self._continue_versions()
        telemetry.observe_version(self.version)
        if self.announcer.behind(self.follower.view.weights, self.version):
            self.publish_weights()
        self.announce_progress(every_s=0.0)
        self.http = telemetry.serve_http(self.ccfg.http, self._health, lambda: self.control, self._writer,
                                         ready=self._ready, status=lambda: self.auto.status(self.control))
        self.readiness.initialised()
        telemetry.started(self.ccfg.run_file, self.http.url, self.kafka.bootstrap_servers, self.step, self.version)

    def _restore(self, latest) -> dict[int, int] | None:
        """Step, version, ledger and reader offsets from the checkpoint resumed (None: none)."""
        if latest is None:
            log.info("no checkpoint in %s: starting at version 0 from the topic's start", self.ccfg.checkpoint_dir)
            return None
        st, path = latest
        self.step, self.version = st.step, st.version
        self.ledger = Ledger.from_checkpoint(st, self.ledger.assembler, telemetry.count_outcome)
        self.lineage = [list(r) for r in st.runs] + [[self.run_id, st.step]]
        self.clock = _gate_clock(self.leader.ckpt, st)
        log.info("resumed from %s: step %d, version %d, offsets %s", path.name, st.step, st.version, st.offsets)
        return st.offsets

    def _continue_versions(self) -> None:
        """Above every version announced or stored: after a crash the steps since
        the checkpoint died with their versions, which producers may hold. (The
        store gets each version before its announcement and keeps the newest, so
        it alone bounds what was announced; the topic covers a store wiped since.)"""
        announced = self.follower.view.weights
        newest = max([announced.version if announced is not None else 0, *self.announcer.store.versions()])
        if newest > self.version:
            log.warning("versions up to %d were published after the checkpoint of version %d (a crash): "
                        "the restored weights continue as version %d", newest, self.version, newest + 1)
            self.version = newest + 1
            self.leader.ckpt.note_version(self.version, self.step)  # before it is announced
            self.clock.anchor(self.version, self.step)

    def _open_reader(self, offsets: dict[int, int] | None):
        # records this consumer cannot take go to the DLQ, not the trainer (consumer/stream/intake.py)
        limits = record_limits(self.leader.trainer.model.hf_dims, self.ccfg.group_size)
        # fetch_max_wait 20 ms at first: tansu 0.6 sees records that arrive during a fetch only
        # after about half its wait, so the default 100 ms added ~50 ms to every global step of
        # a synchronous pipeline; the reader raises it when tansu's log outgrows it
        # (common/kafka/fetch_wait.py)
        return RolloutReader(self.kafka, start_offsets=offsets, blobs=BlobStore(self.kafka.blob_dir),
                             limits=limits, fetch_max_wait_ms=20, check=VersionBound(self.newest_version))

    def newest_version(self) -> int:
        """The newest policy version there can be: this trainer's own. No record may carry a later
        one (consumer/stream/intake.py). Not the policy topic's newest: an announcement is a Kafka message,
        and one a million versions ahead would have let records from the future through. (After a
        restore from an older checkpoint `_continue_versions` moved ours above every announced one.)"""
        return self.version

    def _health(self) -> tuple[bool, dict]:
        """GET /healthz (the HTTP thread): live unless a full batch waits and no step trained it in time."""
        return self.liveness.health({"version": self.version, "step": self.step,
                                     "open_groups": self.ledger.assembler.num_open})

    def _ready(self) -> tuple[bool, dict]:
        return self.readiness.check({"version": self.version, "step": self.step})

    def stop(self, *_):
        self._stop = True
        self.readiness.stopping()

    def close(self) -> None:
        try:
            if getattr(self, "leader", None) is not None:
                self.leader.stop()  # waits for the checkpoint write in flight
        finally:
            self.readiness.close()
            close_attrs(self, ("announcer", "reader", "follower", "_writer", "http"), log)

    # ----------------------------------------------------------------- loop

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        self.start()
        try:
            while not self._stop:
                if self.ccfg.max_steps is not None and self.step >= self.ccfg.max_steps:
                    log.info("reached consumer.max_steps=%d", self.ccfg.max_steps)
                    break
                clock = telemetry.StepClock()
                batch = clock.phase("wait", self.next_batch)
                if batch is None:
                    continue
                step_metrics = clock.phase("train", self.train_step, batch)
                clock.phase("checkpoint", self.checkpoint)
                clock.phase("publish", self.publish_weights)
                telemetry.observe_step(self.step, self.version, step_metrics, batch, clock.phases, self.ledger.counters)
                self.auto.after_step(step_metrics, clock.phases, self.control)
            self.checkpoint(final=True)  # a clean stop leaves nothing to redo
        finally:
            self.close()
        telemetry.stopped(self.ccfg.run_file, self.step, self.version, self.ledger.counters,
                          self.ledger.held_records())
        return 0

    def apply_control(self, catch_up: bool = True) -> None:
        """Take the runtime settings: with `catch_up`, every change acknowledged before this call."""
        events = self.follower.catch_up() if catch_up else self.follower.poll()
        for event in events:
            if isinstance(event, ControlChange):
                log.info("control change applied at batch boundary: %s=%r", event.key, event.value)
        self.control = self.follower.view.state

    def next_batch(self, poll_s: float = 0.2) -> list[ReadyGroup] | None:
        """B groups that passed the gate now; None if interrupted. The batch boundary is
        the moment its first group is about to be gated: the settings are caught up
        there and hold for the whole batch (paused: no group is taken). A group is
        gated when taken into a batch, at the version this step trains at (staleness
        is measured at the optimizer step, docs/algorithm.md); the reader is polled
        only while no complete group waits, so read-ahead stays within one poll."""
        batch: list[ReadyGroup] = []
        boundary = True
        while len(batch) < self.ccfg.groups_per_batch:
            if self._stop:
                self.ledger.put_back()  # untrained: back in line
                self.liveness.has_work("train_step", False)  # stopping: the final checkpoint is no stall
                return None
            self._note_work(batch)
            if boundary and self.ledger.complete:
                self.apply_control()  # the batch boundary
                boundary = False
            if not batch and self.control.paused:
                time.sleep(poll_s)
                self.apply_control(catch_up=False)
            elif (g := self.ledger.take()) is not None:
                d = gate_group(g.rollouts(), self.version, self.control, self.ccfg.filters_zero_variance,
                               self.clock.staleness(self.step))
                self.filtered.note(d)
                telemetry.observe_gate(d.staleness, self.filtered.value)
                if d.keep:
                    batch.append(ReadyGroup(g, d.staleness, d.weights, d.ages))
                else:  # dropped_stale or filtered: the batch is filled from the stream instead
                    self.ledger.drop(g, d.outcome)
            else:
                self._read(poll_s)
        return batch

    def _note_work(self, batch: list[ReadyGroup]) -> None:
        """Work for the liveness check: a full batch is there to train (not paused). Partial
        groups and a partial batch wait for producers, not for this loop: no work."""
        available = len(batch) + len(self.ledger.complete)
        self.liveness.has_work("train_step", not self.control.paused and available >= self.ccfg.groups_per_batch)

    def _read(self, poll_s: float) -> None:
        items = self.reader.poll(max_records=512, timeout_s=poll_s)
        dead = self.reader.take_dead()
        self.ledger.read(items, dead)
        refused = self.ledger.take_refused()  # a reused group id (consumer/stream/assembler.py)
        fenced = self.ledger.take_fenced()  # an older journal claim's copy (consumer/stream/assembler.py)
        if refused or fenced:  # stored before anything is read on, so no checkpoint covers a refusal not stored
            self.reader.refuse([(it, "group_id", why) for it, why in refused]
                               + [(it, "claim_epoch", why) for it, why in fenced])
            telemetry.count_reused(len(refused))
        for g in self.ledger.expire():
            log.warning("group %s timed out with %d/%d samples", g.group_id, len(g.samples), g.group_size)
        self.announce_progress()
        lag = self.reader.lag()
        self.intake.fetch_wait_ms = self.reader.fetch_wait.ms
        self.intake.read(len(items) + len(dead), lag)
        telemetry.observe_read(lag, self.ledger.assembler.num_open, self.ledger.held_records())

    def train_step(self, batch: list[ReadyGroup]) -> dict:
        from rlstream.consumer.train.batch import TrainSample  # defers torch

        scale = self.ccfg.stress.logprob_temperature_scale
        samples = [TrainSample.from_rollout(r, w, a, scale) for rg in batch
                   for r, w, a in zip(rg.group.rollouts(), rg.weights, rg.ages)]
        out = self.leader.train(samples)
        self.liveness.beat("train_step")
        self.intake.stepped()
        # what a replay needs (consumer/logreplay/record.py): the gate's staleness is taken at the
        # step the batch was gated at, before it counts this one
        inputs = step_inputs(batch, self.clock.staleness(self.step), self.control, self.ccfg,
                             self.kafka.topics.rollouts, out, self.leader.world)
        self.step += 1
        self.version += 1
        telemetry.observe_version(self.version)  # before the version leaves: no producer is seen ahead of it
        trained = self.ledger.trained()
        self.leader.ckpt.audit({"step": self.step, "version": self.version, "trained": trained, "run": self.run_id,
                                "inputs": inputs})
        self.clock.trained(trained)
        return out

    def checkpoint(self, final: bool = False) -> None:
        """When due (`final`: whenever a step was trained since the last one): model,
        optimizer, ledger and offsets of this step boundary, written in the background."""
        if not (self.cadence.dirty(self.step) if final else self.cadence.due(self.step)):
            return
        st = self.ledger.to_checkpoint(self.step, self.version, self.reader.positions())
        st.runs = [list(r) for r in self.lineage]
        st.first_gated = dict(self.clock.first_gated)  # a crash before their redo must not age them
        self.leader.checkpoint(st)
        self.cadence.done(self.step)

    def publish_weights(self) -> None:
        self.announcer.weights(self.version, self.leader.export())
        self.announce_progress(every_s=0.0)

    def announce_progress(self, every_s: float = 1.0) -> None:
        self.announcer.progress(self.version, self.reader.positions(), self.ledger.held_records(),
                                self.filtered.value, every_s)


def _gate_clock(ckpt, st) -> GateClock:
    """The gate's clock on a restart from `st`: every version renumbering noted, the
    checkpoint's own version at its step (a checkpoint directory older than the
    note file has only this), and the step each record of a lost step was first
    gated at: the step its audit line names, less one (the gate runs before the
    step counts itself), or the checkpoint's `first_gated` for a record an
    earlier crash had left to redo and that was still held at the checkpoint."""
    first: dict[str, int] = dict(st.first_gated)
    for e in ckpt.audit_since(st.step):
        for rid in e.get("trained", ()):
            first[rid] = min(first.get(rid, e["step"] - 1), e["step"] - 1)
    return GateClock([*ckpt.version_anchors(), (st.version, st.step)], first)


def _weight_backend(backend: str) -> str:
    """`consumer.weights.backend` made concrete (common/weights/backends.py)."""
    import torch

    return resolve(backend, on_gpu=torch.cuda.is_available())


def main(cfg: RlstreamConfig) -> int:
    memory = check_config(cfg, os.environ)  # before any rank loads 60 GB of weights
    if memory is not None:
        log.info("%s", memory.report().lstrip("# "))
        memory.refuse()

    if launch_rank() != 0:  # followers: the trainer, no Kafka (consumer/ranks/protocol.py)
        return run_follower(cfg)
    if launch_world_size() > 1 and not cfg.kafka.bootstrap_servers:
        raise ConfigError("set kafka.bootstrap_servers when running several ranks (torchrun)",
                          key="kafka.bootstrap_servers")
    return run_with_broker(cfg.kafka, cfg.broker, lambda bootstrap: ConsumerService(cfg, bootstrap).run())
