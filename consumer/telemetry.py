"""What the consumer service exposes: its Prometheus metrics (docs/metrics.md
lists every one), the HTTP server of /metrics, /healthz and the admin API,
its run file (common/runfile.py), and one log line per global step.

    clock = StepClock()
    batch = clock.phase("wait", service.next_batch)     # ... train, checkpoint, publish
    observe_step(step, version, metrics, batch, clock.phases, ledger.counters)
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Callable

from rlstream.common import metrics, runfile

log = logging.getLogger("rlstream.consumer")

_RECORDS = metrics.counter("rlstream_consumer_records_total", "Consumed rollout records by outcome", ["outcome"])
_STALENESS = metrics.histogram("rlstream_consumer_staleness_versions", "Staleness (versions) of gated groups",
                               buckets=metrics.STALENESS_BUCKETS)
_VERSION = metrics.gauge("rlstream_consumer_policy_version", "Trainer policy version (completed global steps)")
_LAG = metrics.gauge("rlstream_consumer_lag_records", "Records on the rollouts topic not yet read")
_PHASE = metrics.histogram("rlstream_consumer_step_phase_seconds", "Global step time by phase", ["phase"])
EXPERTS_KERNEL = metrics.gauge("rlstream_trainer_experts_kernel",
                               "MoE experts kernel of this trainer: 1 for the one in use", ["kind"])
_STEP = metrics.gauge("rlstream_trainer_step_metric", "Last global step's trainer metrics", ["name"])
_OPEN = metrics.gauge("rlstream_consumer_open_groups", "Partial groups held by the assembler")
_FILTERED = metrics.gauge("rlstream_consumer_filtered_share",
                          "Share of recent groups within the staleness bound filtered for equal rewards (dynamic sampling)")
_REUSED = metrics.counter("rlstream_consumer_group_reuse_total",
                          "Records refused (DLQ, field group_id) for a group id held by another copy or already closed")
_HELD = metrics.gauge("rlstream_consumer_held_records",
                      "Records read but not yet given an outcome (partial groups + complete groups waiting for a batch)")
WEIGHT_LINKS = metrics.gauge("rlstream_consumer_weight_links", "Producers linked to the weight endpoint now")
WEIGHT_LINK_FAILURES = metrics.counter("rlstream_consumer_weight_link_failures_total",
                                       "Producer links dropped: a dead, hung or refusing producer (the others continue)")
WEIGHT_SEND_SECONDS = metrics.histogram("rlstream_consumer_weight_send_seconds",
                                        "One version to one producer: start until the producer verified it")
WEIGHT_EXPORT_SECONDS = metrics.histogram("rlstream_consumer_weight_export_seconds",
                                          "Gather, pack and hash one version (the snapshot every link sends)")
DURABLE_VERSION = metrics.gauge("rlstream_consumer_durable_version",
                                "Newest version written to the durable weight store")
_SIGNAL = metrics.gauge("rlstream_trainer_signal",
                        "Last global step's stability signals, over every record (staleness=all) and by a "
                        "record's staleness in versions (NaN: no token of that staleness)", ["signal", "staleness"])
_AUTO_CHANGES = metrics.counter("rlstream_staleness_auto_changes_total",
                                "Changes of max_staleness the auto controller decided, by direction, the signal "
                                "that decided it and whether the control topic took them", ["direction", "signal", "published"])
_AUTO_AT_MIN = metrics.gauge("rlstream_staleness_auto_at_min",
                             "1 while the auto controller owns max_staleness and holds it at its tightest limit")


def serve_http(settings, health: Callable, control: Callable, writer, ready: Callable | None = None,
               status: Callable[[], dict] | None = None):
    """/metrics, /healthz, /readyz and the admin API (changes go to the control topic through `writer`;
    `status`: more for GET /admin/control)."""
    from rlstream.common.control.http import start_service_http  # defers uvicorn

    http = start_service_http(settings, health, control, writer, by=f"admin@consumer-{socket.gethostname()}",
                              ready=ready, status=status)
    log.info("consumer http on %s", http.url)
    return http


def started(run_file: str | None, http_url: str, bootstrap: str, step: int, version: int) -> None:
    runfile.write_run_file(run_file, fresh=True, **runfile.started(
        "consumer", http_url, bootstrap, step=step, version=version))


def stopped(run_file: str | None, step: int, version: int, counters: dict[str, float], held: int) -> None:
    """The final log line and run-file record (outcome counters and held records)."""
    log.info("consumer stopped at step %d, version %d; outcomes %s; held %d", step, version, counters, held)
    runfile.write_run_file(run_file, **runfile.stopped(
        step=step, version=version, outcomes=dict(counters), held=held))


def count_outcome(outcome: str, n: int) -> None:
    """The ledger's `on_count`: `n` records got `outcome`."""
    _RECORDS.labels(outcome=outcome).inc(n)


def count_reused(n: int) -> None:
    """`n` records refused for a reused group id (also counted in outcome `dlq`)."""
    _REUSED.inc(n)


def observe_gate(staleness: int, filtered_share: float) -> None:
    _STALENESS.observe(staleness)
    _FILTERED.set(filtered_share)


def observe_read(lag: int, open_groups: int, held: int) -> None:
    _LAG.set(lag)
    _OPEN.set(open_groups)
    _HELD.set(held)


def observe_version(version: int) -> None:
    _VERSION.set(version)


SIGNALS_ALL = {"ess": "ess", "kl": "kl_train_inference", "clip_frac": "clip_frac",
               "is_truncated_frac": "is_truncated_frac", "grad_norm": "grad_norm"}
"""signal label -> step-metric key, for staleness="all"."""
SIGNALS_BY_STALENESS = ("ess", "kl", "clip_frac", "is_truncated_frac", "token_share")


def observe_signals(step_metrics: dict) -> None:
    """The stability signals of a step (consumer/stability/signals.py) as gauges."""
    from rlstream.consumer.stability.signals import LABELS  # defers torch

    nan = float("nan")
    for label, key in SIGNALS_ALL.items():
        v = step_metrics.get(key)
        _SIGNAL.labels(signal=label, staleness="all").set(nan if v is None else v)
    by = step_metrics.get("by_staleness") or {}
    for bucket in LABELS:
        row = by.get(bucket, {})
        for label in SIGNALS_BY_STALENESS:
            v = row.get(label)
            _SIGNAL.labels(signal=label, staleness=bucket).set(nan if v is None else v)


def observe_auto(at_min: bool) -> None:
    _AUTO_AT_MIN.set(1 if at_min else 0)


def count_auto_change(direction: str, signal: str, published: bool) -> None:
    _AUTO_CHANGES.labels(direction=direction, signal=signal, published="true" if published else "false").inc()


class StepClock:
    """Wall time of each named phase of one global step."""

    def __init__(self):
        self.phases: dict[str, float] = {}

    def phase(self, name: str, fn: Callable, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.phases[name] = time.monotonic() - t0


def observe_step(step: int, version: int, step_metrics: dict, batch: list, phases: dict[str, float],
                 counters: dict[str, float]) -> None:
    """Phase histograms, the trainer-metric gauges and the step's log line."""
    for phase, secs in phases.items():
        _PHASE.labels(phase=phase).observe(secs)
    for k, v in step_metrics.items():
        if isinstance(v, (int, float)):
            _STEP.labels(name=k).set(v)
    observe_signals(step_metrics)
    rewards = [r.reward for rg in batch for r in rg.group.rollouts()]
    mean_s = sum(rg.staleness for rg in batch) / len(batch)
    log.info("step=%d version=%d reward=%.3f staleness=%.2f kl=%.4g loss=%.4g wait=%.2fs train=%.2fs publish=%.2fs %s",
             step, version, sum(rewards) / len(rewards), mean_s,
             step_metrics.get("kl_train_inference", float("nan")), step_metrics.get("loss", float("nan")),
             phases["wait"], phases["train"], phases["publish"],
             " ".join(f"{k}={int(v)}" for k, v in counters.items()))
