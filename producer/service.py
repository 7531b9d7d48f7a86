"""The producer service: keep vLLM busy, score, publish, follow the trainer.

    rlstream producer -c configs/tiny-cpu.yaml        (also: python -m rlstream producer)
One thread drives everything, so a weight reload always falls between two
engine steps. Each iteration of the loop:

    follow_control -> evict_stale -> admit (driver.start) -> engine step -> driver.on_finished -> outbox

follow_control applies runtime settings, the trainer's progress and new weights
(producer/weights/reload.py); admit starts groups until producer/admission.py
names a reason to wait; records go to the outbox (producer/outbox.py). How a
group becomes records is the rollout driver's (producer/rollout/, chosen once by
the settings): single-turn samples, episodes against an environment, or
black-box agents over HTTP, which open their groups through the same gate.

On SIGTERM: stop admitting, let in-flight samples finish (up to `producer.drain_timeout_s`,
then abort them), publish every finished sample, wait for every acknowledgement, exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

from rlstream.common import metrics, runfile
from rlstream.common.config import ControlSettings, RlstreamConfig
from rlstream.common.control.http import start_service_http
from rlstream.common.control.liveness import ProgressMonitor, Readiness
from rlstream.common.control.plane import ControlFollower, ControlPlaneWriter
from rlstream.common.control.signing import signing_key
from rlstream.common.kafka.broker import run_with_broker
from rlstream.common.kafka.claimcheck import BlobStore
from rlstream.common.kafka.client import ensure_topics
from rlstream.common.kafka.publisher import RolloutPublisher
from rlstream.common.lifecycle import close_attrs
from rlstream.common.tasks.verifiers import get_verifier
from rlstream.producer import telemetry
from rlstream.producer.admission import AdmissionView, TopicEnds, admission_block
from rlstream.producer.engine import RolloutEngine
from rlstream.producer.following import Following
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.outbox import Outbox
from rlstream.producer.prompts import open_prompt_source
from rlstream.producer.rollout.build import build_driver
from rlstream.producer.sample import SamplingConfig

log = logging.getLogger("rlstream.producer")


class ProducerService:
    def __init__(self, cfg: RlstreamConfig, bootstrap: str):
        self.cfg, self.pcfg = cfg, cfg.producer
        self.kafka = cfg.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        self.producer_id = self.pcfg.producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.sampling = SamplingConfig(max_tokens=self.pcfg.max_tokens, temperature=self.pcfg.temperature,
                                       top_p=self.pcfg.top_p)
        self.groups = InFlightGroups(self.producer_id)
        self._stop, self.stats = False, telemetry.SampleStats()
        # live while requests in the engine get engine steps and a weight update ends in time
        self.liveness = ProgressMonitor(self.pcfg.liveness.stall_after_s)
        self.readiness = Readiness(self.kafka)  # a Kafka request, TLS where the cluster uses it

    # ------------------------------------------------------------ lifecycle

    def start(self, engine=None) -> None:
        """`engine`: an already started RolloutEngine to use (tests share one), else one is built."""
        import torch

        ensure_topics(self.kafka)
        verify = get_verifier(self.pcfg.verifier)
        self.prompts = open_prompt_source(self.pcfg.prompts, self.kafka, verify)
        key = signing_key(self.pcfg.http.admin_token)  # control records verify against it
        control = ControlFollower(self.kafka, ControlSettings.from_settings(self.cfg.staleness), key)
        self.following = Following(control, self.pcfg.group_size)
        torch.set_num_threads(self.pcfg.num_threads)
        self.engine = engine or RolloutEngine(self.pcfg.engine, self.cfg.model.path, version=0)
        self.publisher = RolloutPublisher(self.kafka, BlobStore(self.kafka.blob_dir))
        self.topic_ends = TopicEnds(self.kafka)
        self.outbox = Outbox(self.publisher, lambda f: (self.topic_ends.on_delivered(f), self.driver.on_delivered(f)))
        self._start_http()
        self.driver = build_driver(self.pcfg, self.engine, self.groups, self.sampling, self.producer_id, kafka=self.kafka,
                                   agent_tasks=(self.held_back, self.prompts, verify), rollout_ends=self.topic_ends.current)
        runfile.write_run_file(self.pcfg.run_file, fresh=True, **runfile.started(
            "producer", self.http.url, self.kafka.bootstrap_servers, producer_id=self.producer_id,
            **({"agent_url": self.driver.url} if self.driver.url else {})))
        self.following.start_weights(self.engine, self.cfg, self.producer_id)
        self.readiness.initialised()

    def _start_http(self) -> None:
        self._writer = ControlPlaneWriter(self.kafka, signing_key(self.pcfg.http.admin_token))
        # /healthz: live unless an engine step or weight update overruns its bound; /readyz: loaded, caught up, broker up
        self.http = start_service_http(self.pcfg.http, self._health, lambda: self.following.control, self._writer,
                                       by=f"admin@{self.producer_id}", ready=lambda: self.readiness.check(self._status()))

    def _health(self) -> tuple[bool, dict]:
        return self.liveness.health(self._status())

    def _status(self) -> dict:
        return {"version": self.engine.version, "in_flight": self.engine.num_in_flight, "producer_id": self.producer_id,
                "pending": len(self.outbox.pending), "weights": self.following.weight_state()}

    def stop(self, *_):
        self._stop = True
        self.readiness.stopping()

    # ----------------------------------------------------------------- loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.start()
        log.info("producer %s serving version %d; http %s", self.producer_id, self.engine.version, self.http.url)
        last_log = time.monotonic()
        try:
            while not self._stop:
                self.iterate()
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    log.info("version=%d trainer=%d in_flight=%d pending=%d tok/s=%.0f reward=%.3f",
                             self.engine.version, self.following.progress.trainer_version, self.engine.num_in_flight,
                             len(self.outbox.pending), self.engine.stats.tokens_per_second, self.stats.reward_mean)
            self.drain()
        finally:
            self.close()
        return 0

    def iterate(self) -> None:
        """One pass of the loop: follow_control -> evict_stale -> admit -> engine step -> publish."""
        self.following.follow(self.liveness, self.pcfg.liveness.weight_update_limit_s)  # follow_control
        self.driver.evict_stale(self.following.progress.trainer_version, self.following.control.max_staleness)
        self.admit()
        self.liveness.has_work("engine_step", self.engine.has_work())
        if not self.step() and not self.engine.has_work() and not self.driver.has_work():
            time.sleep(0.02)  # idle: nothing generating, nothing to wait on

    def admission_view(self) -> AdmissionView:
        control = self.following.control
        return AdmissionView(
            paused=control.paused, pending_samples=len(self.outbox.pending), groups_in_flight=len(self.groups),
            max_groups_in_flight=self.pcfg.max_groups_in_flight, progress=self.following.progress,
            engine_version=self.engine.version, max_staleness=control.max_staleness,
            end_offsets=self.topic_ends.current,
            own_unacked_records=self.outbox.unacked_records, group_size=self.pcfg.group_size)

    def held_back(self) -> str | None:
        """Why no group may start now (counted, but `in_flight`), or None."""
        reason = admission_block(self.admission_view())
        if reason is not None and reason != "in_flight":
            telemetry.HELD_BACK.labels(reason=reason).inc()
        return reason

    def admit(self) -> None:
        """Start groups from the prompt source while admission allows (agents open theirs over HTTP)."""
        G = self.pcfg.group_size
        while not self._stop and self.driver.admits_prompts and self.held_back() is None:
            if (prompt := self.prompts.take()) is None:
                telemetry.HELD_BACK.labels(reason="no_prompts").inc()
                break
            self.driver.start(self.groups.open(prompt.task, G), prompt.task, G)
        telemetry.INFLIGHT.set(self.engine.num_in_flight)

    def step(self) -> int:
        """An engine step (if anything generates), its output to the driver, records to the outbox."""
        finished = []
        if self.engine.has_work():
            finished = self.engine.step()
            self.liveness.beat("engine_step")
        for record in self.driver.on_finished(finished):
            self.outbox.add(record)
            self.stats.note(record.num_tokens, record.reward, self.engine.stats.tokens_per_second)
        self.outbox.flush()
        telemetry.INFLIGHT.set(self.engine.num_in_flight)
        return len(finished)

    def drain(self) -> None:
        """SIGTERM: finish in-flight samples (bounded), publish all, flush."""
        deadline = time.monotonic() + self.pcfg.drain_timeout_s
        self.driver.drain(deadline)  # agents: the endpoint closes, open episodes end (`shutdown`)
        while (self.driver.has_work() or self.engine.has_work()) and time.monotonic() < deadline:
            self.step()
        self.driver.abort()
        if aborted := self.engine.abort_all():
            log.warning("aborted %d in-flight samples at shutdown (partial groups are timed out by the consumer)", aborted)
        self.outbox.drain(timeout_s=60)
        acked = metrics.value("rlstream_published_records_total", topic=self.kafka.topics.rollouts)
        log.info("producer drained: published=%d (every finished sample acknowledged by the broker)", acked)
        runfile.write_run_file(self.pcfg.run_file, **runfile.stopped(published=int(acked)))

    def close(self) -> None:
        close_attrs(self, ("driver", "publisher", "following", "engine", "prompts", "topic_ends", "_writer", "http"), log)


def main(cfg: RlstreamConfig) -> int:
    return run_with_broker(cfg.kafka, cfg.broker, lambda bootstrap: ProducerService(cfg, bootstrap).run())
