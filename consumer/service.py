"""The consumer service: read rollouts, gate by staleness, train, checkpoint, publish.

    rlstream consumer -c configs/tiny-cpu.yaml        (also: python -m consumer)

The loop is a sequence of named steps, one global step per iteration:

    apply_control -> next_batch -> train_step -> checkpoint -> publish_weights

Delivery guarantee (exactly-once training): Kafka offsets are committed only
inside a checkpoint, together with the model, optimizer and version they
produced (consumer/checkpoint.py). The checkpointed offset of a partition is
the smallest offset still held (in a partial group or a batch not yet
trained); the rollout ids already processed at or above it are stored too, so
a restarted consumer re-reads what it held and skips what it had processed.
Every consumed record ends in exactly one outcome counter: trained,
dropped_stale, timed_out, duplicate, mismatch or dlq.

Multi-rank (torchrun): rank 0 reads and gates; the chosen samples are
broadcast to every rank, each rank trains on its data-parallel shard. Under
tensor or expert parallelism rank 0 also broadcasts `checkpoint` (each
(tp, ep) shard is written by one rank, rank 0 commits; consumer/checkpoint.py)
and `export` (the weight export gathers every shard) after each step.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import metrics
from common.config import RlstreamConfig
from common.control.messages import ControlChange, ControlState, TrainerProgress, WeightsReady
from common.control.plane import ControlPlaneWriter
from common import runfile
from common.lifecycle import close_attrs
from common.runfile import write_run_file
from consumer.assembler import GroupAssembler, Group
from consumer.staleness import gate_group

log = logging.getLogger("rlstream.consumer")

OUTCOMES = ("trained", "dropped_stale", "timed_out", "duplicate", "mismatch", "dlq")
_RECORDS = metrics.counter("rlstream_consumer_records_total", "Consumed rollout records by outcome", ["outcome"])
_STALENESS = metrics.histogram("rlstream_consumer_staleness_versions", "Staleness (versions) of gated groups",
                               buckets=metrics.STALENESS_BUCKETS)
_VERSION = metrics.gauge("rlstream_consumer_policy_version", "Trainer policy version (completed global steps)")
_LAG = metrics.gauge("rlstream_consumer_lag_records", "Records on the rollouts topic not yet read")
_PHASE = metrics.histogram("rlstream_consumer_step_phase_seconds", "Global step time by phase", ["phase"])
_STEP = metrics.gauge("rlstream_trainer_step_metric", "Last global step's trainer metrics", ["name"])
_OPEN = metrics.gauge("rlstream_consumer_open_groups", "Partial groups held by the assembler")
_HELD = metrics.gauge("rlstream_consumer_held_records",
                      "Records read but not yet given an outcome (partial groups + complete groups waiting for a batch)")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class ReadyGroup:
    group: Group
    staleness: int
    weights: tuple[float, ...]


@dataclass
class LoopState:
    version: int = 0
    step: int = 0
    counters: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in OUTCOMES})
    ready: list[Group] = field(default_factory=list)  # complete, not yet gated
    # (partition, offset, rollout_id) of records processed since they became
    # eligible for a re-read; pruned to those at/above the checkpoint offsets.
    processed: list[tuple[int, int, str]] = field(default_factory=list)


class ConsumerService:
    def __init__(self, cfg: RlstreamConfig, bootstrap: str):
        self.cfg, self.ccfg = cfg, cfg.consumer
        self.kafka = cfg.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        self.state = LoopState()
        self.control = ControlState.from_settings(cfg.staleness)
        self._stop = False
        self._healthy = True
        self._last_trained: list[str] = []
        self._last_step_at = time.time()
        self._progress_sent: TrainerProgress | None = None  # the last progress message we sent
        self._progress_at = 0.0
        self._building: list[ReadyGroup] = []  # gated groups of the batch being built
        self.rank, self.world = int(os.environ.get("RANK", "0")), _world_size()
        # several ranks holding different shards (tensor/expert parallel): every
        # rank takes part in checkpoints and weight exports
        self.sharded = self.world > 1 and (self.ccfg.tensor_parallel_size > 1
                                           or self.ccfg.expert_parallel_size > 1)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        from common.kafka.claimcheck import BlobStore
        from common.control.plane import ControlFollower
        from common.kafka.client import ensure_topics
        from common.kafka.reader import RolloutReader
        from common.record import RecordLimits
        from common.weights.store import WeightStore
        from consumer.checkpoint import CheckpointManager

        self.trainer = self._build_trainer()  # collective under torchrun: every rank
        self.ckpt = CheckpointManager(self.ccfg.checkpoint_dir, self.ccfg.keep_checkpoints)
        latest = self.ckpt.latest() if self.rank == 0 else None
        path = str(latest[1]) if latest else None
        if self.world > 1:  # every rank resumes from the checkpoint rank 0 chose
            path = _broadcast(path)
        if path is not None:
            self.trainer.load_state_dict(self.ckpt.load_trainer_state(
                Path(path), self.trainer.checkpoint_shard()[0]))
        if self.rank != 0:  # followers: the trainer, nothing else
            return
        ensure_topics(self.kafka)
        self.weights = WeightStore(self.ccfg.weight_store_dir, self.ccfg.keep_versions)
        self.assembler = GroupAssembler(self.ccfg.group_size, self.ccfg.group_timeout_s)
        offsets = self._restore(latest)
        # fetch_max_wait 20 ms: tansu 0.6 answers a long-poll fetch only when the wait
        # expires, not when records arrive (measured: latency ~ half the wait), so the
        # default 100 ms added ~50 ms to every global step of a synchronous pipeline
        d = self.trainer.model.hf_dims  # records the model cannot take go to the DLQ, not the trainer
        limits = RecordLimits.for_model(d.vocab_size, d.num_layers, d.topk, d.num_experts)
        self.reader = RolloutReader(self.kafka, start_offsets=offsets, blobs=BlobStore(self.kafka.blob_dir),
                                    limits=limits, fetch_max_wait_ms=20)
        self.follower = ControlFollower(self.kafka, self.control)
        self.follower.poll(timeout_s=1.0)
        self.control = self.follower.view.state
        self._writer = ControlPlaneWriter(self.kafka)
        self._announce_if_needed()
        self._start_http()
        write_run_file(self.ccfg.run_file, fresh=True, **runfile.started(
            "consumer", self.http.url, self.kafka.bootstrap_servers, step=self.state.step, version=self.state.version))

    def _build_trainer(self):
        from consumer.trainer import Trainer, TrainerConfig

        import torch
        torch.set_num_threads(self.ccfg.num_threads)
        tcfg = TrainerConfig(
            loss=self.ccfg.loss, replay=self.ccfg.replay, lr=self.ccfg.lr,
            weight_decay=self.ccfg.weight_decay, grad_clip=self.ccfg.grad_clip,
            eps_low=self.ccfg.eps_low, eps_high=self.ccfg.eps_high, is_cap=self.ccfg.is_cap,
            num_minibatches=self.ccfg.num_minibatches, dtype=self.ccfg.dtype,
            optimizer=self.ccfg.optimizer, advantage=self.ccfg.advantage, tp=self.ccfg.tensor_parallel_size,
            ep=self.ccfg.expert_parallel_size, dp=max(1, _world_size() // self.ccfg.tensor_parallel_size),
        )
        return Trainer.from_hf(self.cfg.model.path, tcfg)

    def _restore(self, latest) -> dict[int, int] | None:
        """Loop state from the checkpoint `start` loaded the trainer from."""
        if latest is None:
            log.info("no checkpoint in %s: starting at version 0 from the topic's start", self.ccfg.checkpoint_dir)
            return None
        st, path = latest
        self.state.version, self.state.step = st.version, st.step
        self.state.counters.update(st.counters)
        self.state.processed = [(int(p), int(o), str(rid)) for p, o, rid in st.processed]
        self.assembler.mark_seen(rid for _, _, rid in self.state.processed)
        log.info("resumed from %s: step %d, version %d, offsets %s", path.name, st.step, st.version, st.offsets)
        return st.offsets

    def _start_http(self) -> None:
        from common.control.http import start_service_http

        self.http = start_service_http(self.ccfg.http, self._health, lambda: self.control,
                                       self._writer, by=f"admin@consumer-{socket.gethostname()}")
        log.info("consumer http on %s", self.http.url)

    def _health(self) -> tuple[bool, dict]:
        return self._healthy, {"version": self.state.version, "step": self.state.step,
                               "open_groups": self.assembler.num_open}

    def stop(self, *_):
        self._stop = True

    def close(self) -> None:
        if self.world > 1 and self.rank == 0 and getattr(self, "trainer", None) is not None:
            _broadcast(("stop", None))
        close_attrs(self, ("reader", "follower", "_writer", "http"), log)

    # ----------------------------------------------------------------- loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.start()
        if self.rank != 0:
            return self.run_follower()
        try:
            while not self._stop:
                if self.ccfg.max_steps is not None and self.state.step >= self.ccfg.max_steps:
                    log.info("reached consumer.max_steps=%d", self.ccfg.max_steps)
                    break
                self.apply_control()
                t0 = time.monotonic()
                batch = self.next_batch()
                if batch is None:
                    continue
                t1 = time.monotonic()
                step_metrics = self.train_step(batch)
                t2 = time.monotonic()
                self.checkpoint()
                t3 = time.monotonic()
                self.publish_weights()
                t4 = time.monotonic()
                self._observe(step_metrics, batch, {"wait": t1 - t0, "train": t2 - t1,
                                                    "checkpoint": t3 - t2, "publish": t4 - t3})
        finally:
            self.close()
        held = self.held_records() if hasattr(self, "assembler") else 0
        log.info("consumer stopped at step %d, version %d; outcomes %s; held %d",
                 self.state.step, self.state.version, self.state.counters, held)
        write_run_file(self.ccfg.run_file, **runfile.stopped(
            step=self.state.step, version=self.state.version, outcomes=dict(self.state.counters), held=held))
        return 0

    def apply_control(self) -> None:
        for event in self.follower.poll():
            if isinstance(event, ControlChange):
                log.info("control change applied at batch boundary: %s=%r", event.key, event.value)
        self.control = self.follower.view.state

    def next_batch(self, poll_s: float = 0.2) -> list[ReadyGroup] | None:
        """B groups that passed the gate now; None if interrupted.

        Complete groups wait ungated in `state.ready`; each is gated when it is
        taken into a batch, against the version this step trains at and the
        control state of this batch boundary (docs/algorithm.md: staleness is measured
        at the optimizer step). The reader is polled only while fewer than B
        groups are waiting, so read-ahead stays within one poll.
        """
        B, batch = self.ccfg.groups_per_batch, []
        self._building = batch  # gated, not yet trained: counted by held_records()
        while len(batch) < B:
            if self.state.ready:
                self._gate(self.state.ready.pop(0), batch)
                continue
            if self._stop:
                self.state.ready[:0] = [rg.group for rg in batch]  # untrained: back in line
                self._building = []
                return None
            if self.control.paused:
                time.sleep(poll_s)
                self.apply_control()
                continue
            self._consume(self.reader.poll(max_records=512, timeout_s=poll_s))
            self._expire()
            self.announce_progress()
            _LAG.set(self.reader.lag())
            _OPEN.set(self.assembler.num_open)
            _HELD.set(self.held_records())
        return batch

    def held_records(self) -> int:
        """Records read and not yet counted in an outcome (they are re-read after a restart)."""
        return (sum(len(g.samples) for g in self.assembler.open_groups())
                + sum(len(g.samples) for g in self.state.ready)
                + sum(len(rg.group.samples) for rg in self._building))

    def _count(self, outcome: str, n: int = 1) -> None:
        self.state.counters[outcome] += n
        _RECORDS.labels(outcome=outcome).inc(n)

    def _consume(self, items) -> None:
        dead = self.reader.take_dead()  # dead letters: counted once, even when re-read
        seen = {(p, o) for p, o, _ in self.state.processed} if dead else set()
        for p, o in dead:
            if (p, o) not in seen:
                self._count("dlq")
                self.state.processed.append((p, o, f"dlq:{p}:{o}"))
        for it in items:
            res = self.assembler.add(it.rollout, it.partition, it.offset)
            if res.outcome in ("duplicate", "mismatch"):
                self._count(res.outcome)
                self.state.processed.append((it.partition, it.offset, it.rollout.rollout_id))
            elif res.outcome == "completed":
                self.state.ready.append(res.group)

    def _gate(self, g: Group, batch: list[ReadyGroup]) -> None:
        d = gate_group(g.rollouts(), self.state.version, self.control)
        _STALENESS.observe(d.staleness)
        if d.keep:
            batch.append(ReadyGroup(g, d.staleness, d.weights))
        else:
            self._finish_group(g, "dropped_stale")

    def _expire(self) -> None:
        for g in self.assembler.expire():
            log.warning("group %s timed out with %d/%d samples", g.group_id, len(g.samples), g.group_size)
            self._finish_group(g, "timed_out")

    def _finish_group(self, g: Group, outcome: str) -> None:
        self._count(outcome, len(g.samples))
        self.state.processed.extend((h.partition, h.offset, h.rollout.rollout_id) for h in g.samples.values())

    def train_step(self, batch: list[ReadyGroup]) -> dict:
        from consumer.batch import TrainSample

        samples = []
        for rg in batch:
            for r, w in zip(rg.group.rollouts(), rg.weights):
                samples.append(TrainSample(
                    prompt_ids=r.prompt_ids, response_ids=r.response_ids, logprobs=r.logprobs,
                    reward=r.reward, group_id=r.group_id, routed_experts=r.routed_experts,
                    sample_weight=w))
        if self.world > 1:
            _broadcast(("train", samples))
        out = self.trainer.train_step(self.trainer.build_batch(samples, self.ccfg.group_size))
        self.state.step += 1
        self.state.version += 1
        self._last_trained = []
        for rg in batch:
            self._finish_group(rg.group, "trained")
            self._last_trained.extend(r.rollout_id for r in rg.group.rollouts())
        self._building = []
        return out

    def _safe_offsets(self) -> dict[int, int]:
        safe = dict(self.reader.positions())
        pending = self.assembler.pending_min_offsets()
        for g in self.state.ready + [rg.group for rg in self._building]:
            for p, o in g.offsets():
                pending[p] = min(pending.get(p, o), o)
        for p, o in pending.items():
            safe[p] = min(safe.get(p, o), o)
        return safe

    def checkpoint(self) -> None:
        from consumer.checkpoint import CheckpointState

        safe = self._safe_offsets()
        self.state.processed = [t for t in self.state.processed if t[1] >= safe.get(t[0], 0)]
        self._audit({"step": self.state.step, "version": self.state.version, "trained": self._last_trained})
        st = CheckpointState(self.state.step, self.state.version, safe,
                             [list(t) for t in self.state.processed], dict(self.state.counters))
        if not self.sharded:
            self.ckpt.save(st, self.trainer.state_dict())
            return
        tmp = self.ckpt.begin(st.step)
        _broadcast(("checkpoint", str(tmp)))
        shards = self._write_shard(tmp)
        self.ckpt.commit(tmp, st, shards)

    def _write_shard(self, tmp) -> list[str]:
        """Collective: this rank's trainer-state shard into `tmp` (if it is the
        writer of its (tp, ep) pair), then a barrier; returns every shard name."""
        import torch.distributed as dist

        name, writes, shards = self.trainer.checkpoint_shard()
        if writes:
            self.ckpt.write_shard(Path(tmp), name, self.trainer.state_dict())
        dist.barrier()
        return shards

    def _audit(self, entry: dict) -> None:
        """Append to <checkpoint_dir>/trained.jsonl (before the checkpoint commits).

        A step whose checkpoint never committed is redone after a restart and
        logged again under the same step number: the last line per step is the
        committed one. Operators and tests use it to check exactly-once.
        """
        import json

        with open(self.ckpt.root / "trained.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def publish_weights(self) -> None:
        v = self.state.version
        if self.sharded:
            _broadcast(("export", None))  # the export gathers every rank's shard
        m = self.weights.write(v, self.trainer.export_hf_state_dict(), self.cfg.model.path)
        self._writer.announce(WeightsReady(version=v, uri=m["uri"], sha256=m["sha256"], bytes=m["bytes"]))
        _VERSION.set(v)
        self.announce_progress(every_s=0.0)

    def announce_progress(self, every_s: float = 1.0) -> None:
        """Tell producers where the trainer is (`TrainerProgress`), at most every
        `every_s` seconds and only when something changed.

        Producers count the groups queued ahead of a new one from the read
        offsets and held records; without updates while the trainer waits,
        records the gate dropped (or DLQ'd, or timed out) would count as
        queued until the next step, and a pipeline whose queue was all
        dropped would wait forever.
        """
        now = time.monotonic()
        if now - self._progress_at < every_s:
            return
        self._progress_at = now
        msg = TrainerProgress(trainer_version=self.state.version, read_offsets=dict(self.reader.positions()),
                              held_records=self.held_records(), groups_per_batch=self.ccfg.groups_per_batch,
                              group_size=self.ccfg.group_size)
        sent = self._progress_sent
        if sent is None or sent.model_dump(exclude={"created_at"}) != msg.model_dump(exclude={"created_at"}):
            self._writer.announce(msg)
            self._progress_sent = msg

    def _announce_if_needed(self) -> None:
        latest = self.follower.view.weights
        if latest is None or latest.version < self.state.version:
            self.publish_weights()
        else:  # already announced (a restart): tell producers where we are
            self.announce_progress(every_s=0.0)
        _VERSION.set(self.state.version)

    def _observe(self, step_metrics: dict, batch: list[ReadyGroup], phases: dict) -> None:
        for phase, secs in phases.items():
            _PHASE.labels(phase=phase).observe(secs)
        for k, v in step_metrics.items():
            if isinstance(v, (int, float)):
                _STEP.labels(name=k).set(v)
        rewards = [r.reward for rg in batch for r in rg.group.rollouts()]
        mean_s = sum(rg.staleness for rg in batch) / len(batch)
        log.info("step=%d version=%d reward=%.3f staleness=%.2f kl=%.4g loss=%.4g wait=%.2fs train=%.2fs publish=%.2fs %s",
                 self.state.step, self.state.version, sum(rewards) / len(rewards), mean_s,
                 step_metrics.get("kl_train_inference", float("nan")), step_metrics.get("loss", float("nan")),
                 phases["wait"], phases["train"], phases["publish"],
                 " ".join(f"{k}={int(v)}" for k, v in self.state.counters.items()))


    def run_follower(self) -> int:
        """Ranks > 0: train on this rank's share of what rank 0 broadcasts.

        SIGTERM only sets a flag here: rank 0 stops at its next batch boundary
        and broadcasts `stop`, so every rank leaves between steps.
        """
        log.info("rank %d/%d following rank 0", self.rank, self.world)
        while True:
            kind, arg = _broadcast(None)
            if kind == "stop":
                log.info("rank %d stopping with rank 0", self.rank)
                return 0
            if kind == "train":
                self.trainer.train_step(self.trainer.build_batch(arg, self.ccfg.group_size))
            elif kind == "checkpoint":
                self._write_shard(arg)
            elif kind == "export":
                self.trainer.export_hf_state_dict()
            else:
                raise RuntimeError(f"rank {self.rank}: unknown message {kind!r} from rank 0")


def _broadcast(obj):
    """Rank 0 sends `obj` to every rank (gloo/nccl object broadcast); returns it."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(cfg: RlstreamConfig) -> int:
    from common.kafka.broker import run_with_broker

    if int(os.environ.get("RANK", "0")) != 0:  # followers: no Kafka
        return ConsumerService(cfg, cfg.kafka.bootstrap_servers or "").run()
    if _world_size() > 1 and not cfg.kafka.bootstrap_servers:
        from common.errors import ConfigError
        raise ConfigError("set kafka.bootstrap_servers when running several ranks (torchrun)",
                          key="kafka.bootstrap_servers")
    return run_with_broker(cfg.kafka, cfg.broker, lambda bootstrap: ConsumerService(cfg, bootstrap).run())
