"""The producer service: keep vLLM busy, score, publish, follow the trainer.

    rlstream producer -c configs/tiny-cpu.yaml        (also: python -m producer)

One thread drives everything, so a weight reload always falls between two
engine steps. Each iteration of the loop:

    follow_control -> evict_stale -> admit -> engine step -> score_and_publish

follow_control applies runtime settings, the trainer's progress and new weights
(producer/weights/reload.py: over the link to the trainer, or from the durable store); evict_stale aborts
in-flight groups the trainer can no longer take (producer/eviction.py); admit starts groups until producer/admission.py names a
reason to wait; score_and_publish scores each finished sample and hands its
record (producer/sample.py) to the outbox (producer/outbox.py).

With `producer.episodes` set, each sample is a multi-turn episode
(producer/episodes.py, docs/multi-turn.md): admit starts G episodes per prompt,
the engine's finished turns go to the `EpisodeRunner`, which submits next turns,
and ended episodes (scored by their environment) are published instead.

With `producer.agent_endpoint` set, black-box agents drive the episodes over an
OpenAI-compatible API (producer/agents.py, producer/agent_http.py): the producer
admits no group of its own; `serve_agents` runs the agents' requests (a group is
opened only where admission would start one) and publishes their closed episodes.

On SIGTERM: stop admitting, let in-flight samples finish (up to
`producer.drain_timeout_s`, then abort them), publish every finished sample,
wait for every acknowledgement, exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

from common import metrics, runfile
from common.config import ControlSettings, RlstreamConfig
from common.control.liveness import ProgressMonitor, Readiness
from common.control.messages import TrainerProgress, WeightsReady
from common.lifecycle import close_attrs
from producer import telemetry
from producer.admission import AdmissionView, TopicEnds, admission_block
from producer.eviction import StaleEviction, stale_groups
from producer.groups import GroupInfo, InFlightGroups
from producer.outbox import Outbox
from producer.sample import SamplingConfig

log = logging.getLogger("rlstream.producer")


class ProducerService:
    def __init__(self, cfg: RlstreamConfig, bootstrap: str):
        self.cfg, self.pcfg = cfg, cfg.producer
        self.kafka = cfg.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        self.producer_id = self.pcfg.producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.control = ControlSettings.from_settings(cfg.staleness)
        # the trainer's last TrainerProgress; until one arrives: version 0, B = 1
        # (the most cautious estimate), nothing read
        self.progress = TrainerProgress(trainer_version=0, groups_per_batch=1, group_size=self.pcfg.group_size)
        self.sampling = SamplingConfig(max_tokens=self.pcfg.max_tokens, temperature=self.pcfg.temperature,
                                       top_p=self.pcfg.top_p)
        self.groups = InFlightGroups(self.producer_id)
        self.episodes = None  # producer/episodes.py EpisodeRunner when producer.episodes is set
        self.agents = None  # producer/agents.py AgentEpisodes when producer.agent_endpoint is set
        self.journal = self.resumer = None  # producer/journal/ with episodes and producer.journal.enabled
        self._stop = False
        self.stats = telemetry.SampleStats()
        # live while requests in the engine get engine steps and a weight update ends in time
        self.liveness = ProgressMonitor(self.pcfg.liveness.stall_after_s)
        self.readiness = Readiness(self.kafka.bootstrap_servers)
        self.eviction = StaleEviction()

    # ------------------------------------------------------------ lifecycle

    def start(self, engine=None) -> None:
        """`engine`: an already started RolloutEngine to use (tests share one), else one is built."""
        import torch

        from common.control.plane import ControlFollower
        from common.kafka.claimcheck import BlobStore
        from common.kafka.client import ensure_topics
        from common.kafka.publisher import RolloutPublisher
        from producer.engine import RolloutEngine
        from producer.prompts import open_prompt_source
        from producer.weights.reload import Reloader
        from producer.verifiers import get_verifier

        ensure_topics(self.kafka)
        self.verify = get_verifier(self.pcfg.verifier)
        self.prompts = open_prompt_source(self.pcfg.prompts, self.kafka, self.verify)
        self.follower = ControlFollower(self.kafka, self.control)
        self.follower.catch_up()  # every setting and announcement on the topics, before the engine starts
        torch.set_num_threads(self.pcfg.num_threads)
        self.engine = engine or RolloutEngine(self.pcfg.engine, self.cfg.model.path, version=0)
        self.episodes = self._episode_runner()
        self.publisher = RolloutPublisher(self.kafka, BlobStore(self.kafka.blob_dir))
        self.topic_ends = TopicEnds(self.kafka)
        self.outbox = Outbox(self.publisher, on_delivered=self._on_delivered)
        self._start_journal()
        self._start_http()
        agent_url = self._start_agents()
        runfile.write_run_file(self.pcfg.run_file, fresh=True, **runfile.started(
            "producer", self.http.url, self.kafka.bootstrap_servers, producer_id=self.producer_id,
            **({"agent_url": agent_url} if agent_url else {})))
        self.reloader = Reloader(self.engine, self.cfg.model.path, self.producer_id,
                                 self.pcfg.engine.weight_transfer_timeout_s)
        self.follow_control(weights=False)
        if self.follower.view.weights is not None:  # catch up to the newest announced version before generating
            self.reloader.catch_up(self.follower.view.weights)
        self.readiness.initialised()

    def _episode_runner(self):
        """The multi-turn runner, or None (single-turn: the default)."""
        if self.pcfg.episodes is None or self.pcfg.agent_endpoint is not None:
            return None  # with agents, producer.episodes gives their limits only
        from producer.envs import env_factory
        from producer.episodes import EpisodeRunner

        return EpisodeRunner(self.engine, self.pcfg.episodes, self.sampling, env_factory(self.pcfg.episodes))

    def _start_journal(self) -> None:
        """Durable partial episodes (producer/journal/): journal every turn, resume orphans."""
        if self.episodes is None or not self.pcfg.journal.enabled:
            return
        from producer.envs import env_factory
        from producer.journal import EpisodeJournal, JournalTopic, Resumer

        self.journal = EpisodeJournal(JournalTopic(self.kafka), self.producer_id, self.pcfg.journal)
        self.journal.start()
        self.episodes.journal = self.journal
        self.resumer = Resumer(self.journal, self.episodes, self.groups, env_factory(self.pcfg.episodes), self.verify)

    def _on_delivered(self, fut) -> None:  # the publisher's thread
        self.topic_ends.on_delivered(fut)
        if self.journal is not None:
            self.journal.on_delivered(fut)

    def _start_agents(self) -> str | None:
        """The black-box agent endpoint (producer.agent_endpoint), or None; returns its URL."""
        if self.pcfg.agent_endpoint is None:
            return None
        from common.config import EpisodeSettings
        from producer.agent_http import AgentHttp
        from producer.agents import AgentEpisodes

        self.agents = AgentEpisodes(self.engine, self.pcfg.agent_endpoint, self.pcfg.episodes or EpisodeSettings(),
                                    self.sampling, self.groups, self.pcfg.group_size, self._agent_task,
                                    self.producer_id)
        self.agent_http = AgentHttp(self.pcfg.agent_endpoint, self.agents).start()
        return self.agent_http.url

    def _start_http(self) -> None:
        from common.control.http import start_service_http
        from common.control.plane import ControlPlaneWriter

        self._writer = ControlPlaneWriter(self.kafka)
        self.http = start_service_http(self.pcfg.http, self._health, lambda: self.control,
                                       self._writer, by=f"admin@{self.producer_id}", ready=self._ready)

    def _health(self) -> tuple[bool, dict]:
        """GET /healthz (the HTTP thread): live unless requests wait for an engine step, or a
        weight update blocks the loop, beyond their bounds (producer.liveness)."""
        return self.liveness.health(self._status())

    def _ready(self) -> tuple[bool, dict]:
        """GET /readyz: the engine loaded and caught up to the announced version, the broker reachable."""
        return self.readiness.check(self._status())

    def _status(self) -> dict:
        return {"version": self.engine.version, "in_flight": self.engine.num_in_flight,
                "pending": len(self.outbox.pending), "producer_id": self.producer_id}

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
                    self._log_progress()
            self.drain()
        finally:
            self.close()
        return 0

    def iterate(self) -> None:
        """One pass of the loop: follow_control -> evict_stale -> admit (or serve the agents) -> engine step
        -> publish."""
        self.follow_control()
        self.evict_stale()
        self.resume_orphans()
        self.admit()
        self.serve_agents()
        self.liveness.has_work("engine_step", self.engine.has_work())
        if self.episodes is not None and self.episodes.has_work():
            self.step_episodes()
        elif self.engine.has_work():
            self.score_and_publish(self.engine_step())
        else:
            self.outbox.flush()
            time.sleep(0.02)

    def follow_control(self, weights: bool = True) -> None:
        newest = None
        for event in self.follower.poll():
            if isinstance(event, WeightsReady):
                newest = event  # only the newest version of a poll matters
        if weights:  # bounded: a transfer that never ends (a hung trainer, NCCL without a timeout) is not live
            with self.liveness.operation("weight_update", self.pcfg.liveness.weight_update_limit_s):
                if newest is not None:
                    self.reloader.apply(newest)
                self.reloader.tick()  # the link: the trainer's commands, a received version to swap in
        view = self.follower.view  # also what polls before this one saw (start-up)
        if view.progress is not None:
            self.progress = view.progress
            telemetry.TRAINER_VERSION.set(view.progress.trainer_version)
        self.control = view.state

    def evict_stale(self) -> None:
        """Abort the in-flight groups the trainer can no longer take within max_staleness
        (producer/eviction.py) and free their slots. Single-turn groups only: episodes
        and agents keep their own requests."""
        if self.episodes is not None or self.agents is not None:
            return
        V, bound = self.progress.trainer_version, self.control.max_staleness
        if not self.eviction.due(V, bound):
            return
        for gid in stale_groups(self.engine.oldest_versions(), V, bound):
            aborted = self.engine.abort_tag(gid)
            self.groups.drop(gid)
            telemetry.EVICTED_GROUPS.inc()
            telemetry.EVICTED_SAMPLES.inc(aborted)
            log.info("evicted stale group %s (%d samples in flight): trainer %d, max_staleness %d",
                     gid, aborted, V, bound)

    def resume_orphans(self) -> None:
        """Resume the journaled episodes of dead producers (or of this one's last run) that fall to us."""
        if self.resumer is not None and not self._stop:
            from producer.journal import StalenessView

            self.resumer.tick(StalenessView(self.progress.trainer_version, self.control.max_staleness))

    def admission_view(self) -> AdmissionView:
        return AdmissionView(
            paused=self.control.paused, pending_samples=len(self.outbox.pending), groups_in_flight=len(self.groups),
            max_groups_in_flight=self.pcfg.max_groups_in_flight, progress=self.progress,
            engine_version=self.engine.version, max_staleness=self.control.max_staleness,
            end_offsets=self.topic_ends.current,
            own_unacked_records=self.outbox.unacked_records, group_size=self.pcfg.group_size)

    def admit(self) -> None:
        while not self._stop and self.agents is None:  # with agents, they open the groups
            reason = admission_block(self.admission_view())
            if reason is not None:
                if reason != "in_flight":
                    telemetry.HELD_BACK.labels(reason=reason).inc()
                return
            prompt = self.prompts.take()
            if prompt is None:
                telemetry.HELD_BACK.labels(reason="no_prompts").inc()
                return
            gid = self.groups.new_id()
            if self.episodes is not None:
                self._start_episodes(gid, prompt)
                continue
            ids = self.engine.encode(prompt.text)
            self.engine.submit_group(ids, n=self.pcfg.group_size, tag=gid, sampling=self.sampling)
            self.groups.add(gid, GroupInfo(prompt.text, prompt.answer, ids, self.pcfg.group_size, prompt.score))
        telemetry.INFLIGHT.set(self.engine.num_in_flight)

    def engine_step(self) -> list:
        """One engine step; the agents' turns go to them, the rest is returned."""
        finished = self.engine.step()
        self.liveness.beat("engine_step")
        return finished if self.agents is None else self.agents.claim(finished)

    def serve_agents(self) -> None:
        """Run the agents' queued requests; publish the episodes they closed."""
        if self.agents is None:
            return
        for record in self.agents.poll():
            self.outbox.add(record)
            self.stats.note(record.num_tokens, record.reward, self.engine.stats.tokens_per_second)
        self.outbox.flush()

    def _agent_task(self, body: dict):
        """The task of a group an agent opens, or the admission reason that holds it back."""
        from producer.agents import task_for

        reason = admission_block(self.admission_view())
        if reason is not None and reason != "in_flight":
            telemetry.HELD_BACK.labels(reason=reason).inc()
        return reason or task_for(body, self.prompts, self.verify)

    def score_and_publish(self, finished) -> None:
        for s in finished:
            info = self.groups.finish_sample(s.tag)
            text = self.engine.decode(s.response_ids)
            reward, rinfo = info.score(text) if info.score is not None else self.verify(text, info.answer)
            self.outbox.add(s.to_rollout(float(reward), rinfo, self.producer_id, self.sampling,
                                             prompt_text=info.prompt_text))
            self.stats.note(int(s.response_ids.size), float(reward), self.engine.stats.tokens_per_second)
        self.outbox.flush()
        telemetry.INFLIGHT.set(self.engine.num_in_flight)

    def _start_episodes(self, gid: str, prompt) -> None:
        from producer.episodes import EpisodeTask

        answer, verify = prompt.answer, self.verify
        if self.journal is not None:
            self.journal.on_group(gid, own_score=prompt.score is not None)
        score = prompt.score or (lambda text: verify(text, answer))
        for i in range(self.pcfg.group_size):
            self.episodes.start(gid, i, self.pcfg.group_size, EpisodeTask(prompt.text, prompt.answer, score))
        self.groups.add(gid, GroupInfo(prompt.text, prompt.answer, None, self.pcfg.group_size, prompt.score))

    def step_episodes(self) -> None:
        """One engine step (if a turn is generating), then every episode's environment
        answers so far; publish the episodes that ended."""
        finished = self.engine_step() if self.engine.has_work() else []
        for ep in self.episodes.advance(finished, wait_s=0.0 if finished else 0.02):
            info = self.groups.finish_sample(ep.group_id)
            record = ep.to_rollout(self.producer_id, self.episodes.sampling, prompt_text=info.prompt_text)
            self.outbox.add(self.journal.stamp(record) if self.journal is not None else record)
            self.stats.note(int(ep.response_ids.size), float(ep.reward), self.engine.stats.tokens_per_second)
        for gid in self.episodes.take_unrecorded():  # ended before a model turn: nothing to publish
            self.groups.finish_sample(gid)
        self.outbox.flush()
        telemetry.INFLIGHT.set(self.engine.num_in_flight)

    def _log_progress(self) -> None:
        log.info("version=%d trainer=%d in_flight=%d pending=%d tok/s=%.0f reward=%.3f",
                 self.engine.version, self.progress.trainer_version, self.engine.num_in_flight, len(self.outbox.pending),
                 self.engine.stats.tokens_per_second, self.stats.reward_mean)

    def drain(self) -> None:
        """SIGTERM: finish in-flight samples (bounded), publish all, flush."""
        deadline = time.monotonic() + self.pcfg.drain_timeout_s
        if self.agents is not None:  # open agent episodes end (`shutdown`); their turns finish below
            self.agent_http.stop()
            self.agents.shutdown()
        while self.episodes is not None and self.episodes.has_work() and time.monotonic() < deadline:
            self.step_episodes()
        while self.engine.has_work() and time.monotonic() < deadline:
            self.score_and_publish(self.engine_step())
        if self.episodes is not None:
            self.episodes.abort_all()
        aborted = self.engine.abort_all()
        if aborted:
            log.warning("aborted %d in-flight samples at shutdown (partial groups are timed out by the consumer)", aborted)
        self.outbox.drain(timeout_s=60)
        acked = metrics.value("rlstream_published_records_total", topic=self.kafka.topics.rollouts)
        log.info("producer drained: published=%d (every finished sample acknowledged by the broker)", acked)
        runfile.write_run_file(self.pcfg.run_file, **runfile.stopped(published=int(acked)))

    def close(self) -> None:
        close_attrs(self, ("agent_http", "episodes", "publisher", "journal", "follower", "engine", "prompts", "topic_ends", "_writer", "http", "reloader"), log)


def main(cfg: RlstreamConfig) -> int:
    from common.kafka.broker import run_with_broker

    return run_with_broker(cfg.kafka, cfg.broker, lambda bootstrap: ProducerService(cfg, bootstrap).run())
