"""Soak run (issue #8.7): several vLLM producers at full speed, one consumer, max_staleness changes.

    .venv/bin/python tests/bench/soak.py                   # ~10 minutes, 3 producers
    .venv/bin/python tests/bench/soak.py --duration-s 120 --producers 2
    .venv/bin/python tests/bench/soak.py --smoke            # 1 producer, 10 s (~1 min with start and drain)

Not part of the test run (tests/bench is ignored by pytest). Starts its own
tansu broker on loopback, builds the tiny model, runs the real services as
subprocesses (ops/harness/supervisor.py), changes `max_staleness` through the
consumer's admin API at 1/3 and 2/3 of the run, and samples every
`--sample-s` seconds: records published, consumer outcomes and lag, and the
resident memory of every service (process group). At the end the producers
drain (SIGTERM: every finished sample acknowledged), the consumer reads
everything, a filler group flushes a possible half batch, and the consumer
stops cleanly. Final counters come from the services' run files (the
producers' `published`, the consumer's `outcomes`), the wait for data per
step from the consumer's `rlstream_consumer_step_phase_seconds{phase="wait"}`
histogram (buckets of common/metrics.py LATENCY_BUCKETS; 10 s is a bound, so
the stall check is exact). Phases: setup -> warm -> measure -> drain -> report.
Prints ONE JSON object:

    records_per_s            published records / run seconds
    lag_records              {max, mean, last} of the consumer's lag gauge
    rss_mb                   per service: first-third and last-third medians, growth %,
                             and late_growth_pct: last sixth vs the sixth after the midpoint
                             (warm-up allocations excluded: a leak keeps growing here)
    memory_flat              every service grew < 10 % first vs last third
    step_wait_s              the consumer's wait for data per global step during the run (the
                             steps before the first one finished, i.e. the engines' start, and
                             the drain excluded): {steps, over_10s, max_le, p99_le}; the
                             last two are histogram bucket bounds (the wait is at most that)
    stall_free               no step waited more than 10 s (a backpressure deadlock shows here)
    published / trained / dropped_stale / timed_out / dlq / duplicate
    lost                     published - (trained + dropped_stale + timed_out + dlq); must be 0
    trained_twice            rollout ids in the audit log more than once; must be 0
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

WAIT_BUCKETS = "rlstream_consumer_step_phase_seconds_bucket"
SMOKE = dict(duration_s=10.0, producers=1, sample_s=2.0)


@dataclass
class Soak:
    args: argparse.Namespace
    tmp: Path
    broker: object
    kafka: object
    ckpt: Path
    consumer: object
    producers: list
    samples: list[dict] = field(default_factory=list)
    staleness_changes: list[dict] = field(default_factory=list)
    waits: dict = field(default_factory=dict)  # {"start"|"end": wait-histogram snapshot}
    run_s: float = 0.0
    published: int = 0
    fillers: list = field(default_factory=list)
    outcomes: dict = field(default_factory=dict)

    @property
    def services(self) -> list:
        return [self.consumer, *self.producers]


# ---------------------------------------------------------------------------- setup

def start_broker(work_dir: str | None, prefix: str):
    """(work dir, tiny model dir, a started tansu broker on a free port, its KafkaSettings with
    2 rollouts partitions): what the soak and tests/bench/hostile.py start from."""
    from rlstream.common.config import BrokerSettings
    from rlstream.common.kafka.broker import EmbeddedBroker
    from rlstream.toy.tinymodel import build_tiny_model
    from tests.fixtures.kafka import make_kafka_settings

    tmp = Path(work_dir or tempfile.mkdtemp(prefix=prefix))
    tmp.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(tmp / "tiny-model")
    broker = EmbeddedBroker(BrokerSettings(port=0)).start()
    return tmp, model, broker, make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)


def setup(args) -> Soak:
    """Tiny model, broker, topics, task data, one config per producer; nothing started."""
    from rlstream.harness.supervisor import Service
    from tests.support.configs import ensure_prompts, service_config, write_config

    G, B = args.group_size, args.groups_per_batch
    tmp, model, broker, kafka = start_broker(args.work_dir, "rlstream-soak-")
    cfg = service_config(kafka, model, tmp, G=G, B=B, staleness={"max_staleness": 2},
                         consumer={"group_timeout_s": 30.0})
    ensure_prompts(cfg, n_train=256)
    consumer = Service("consumer", write_config(cfg, tmp / "consumer.yaml"), tmp / "logs")
    producers = []
    for i in range(args.producers):
        pc = cfg.model_copy(deep=True)
        pc.producer.producer_id = f"soak-p{i}"
        pc.producer.prompts.seed = i
        producers.append(Service("producer", write_config(pc, tmp / f"producer-{i}.yaml"), tmp / "logs",
                                 name=f"producer-{i}"))
    return Soak(args, tmp, broker, kafka, Path(cfg.consumer.checkpoint_dir), consumer, producers)


# ---------------------------------------------------------------------------- warm

def warm(soak: Soak) -> None:
    """Every service up and the first global step done (the engines have started)."""
    start_all(soak.services, soak.ckpt)
    soak.waits["start"] = wait_histogram(soak.consumer.scrape())


def start_all(services: list, ckpt: Path) -> None:
    """Start every service, wait until each is ready and the first global step is trained."""
    from rlstream.harness.supervisor import wait_until
    from tests.support.audit import audit_steps

    for s in services:
        s.start()
    for s in services:
        s.wait_ready(600)
    wait_until(lambda: max(audit_steps(ckpt), default=0) >= 1, 600, "the first step", services)


def wait_histogram(text: str) -> dict[float, float]:
    """Cumulative counts of the consumer's per-step wait for data, by bucket bound."""
    from rlstream.harness.observe import parse

    return {float(dict(labels)["le"]): v for (name, labels), v in parse(text).items()
            if name == WAIT_BUCKETS and dict(labels).get("phase") == "wait"}


# ---------------------------------------------------------------------------- measure

def measure(soak: Soak) -> None:
    """Run for --duration-s: change max_staleness at 1/3 and 2/3, sample every --sample-s."""
    args = soak.args
    t0 = time.monotonic()
    plan = [(args.duration_s / 3, 4), (2 * args.duration_s / 3, 1)]
    while (el := time.monotonic() - t0) < args.duration_s:
        if plan and el >= plan[0][0]:
            _, value = plan.pop(0)
            soak.staleness_changes.append({"at_s": round(el, 1), "value": value,
                                           "http": set_max_staleness(soak.consumer, value)})
        soak.samples.append(sample(soak, el))
        for s in soak.services:
            assert s.alive, f"{s.name} died:\n{s.log_tail()}"
        time.sleep(args.sample_s)
    soak.run_s = time.monotonic() - t0
    soak.waits["end"] = wait_histogram(soak.consumer.scrape())  # the drain's waits are not the run's


def set_max_staleness(consumer, value: int) -> int:
    from rlstream.harness.observe import http_request
    from tests.support.configs import ADMIN_TOKEN

    code, _ = http_request(consumer.url + "/admin/control", "POST", {"key": "max_staleness", "value": value},
                           token=ADMIN_TOKEN)
    return code


def sample(soak: Soak, el: float) -> dict:
    from rlstream.harness.observe import metric_value
    from rlstream.common.process import group_rss_bytes

    text = soak.consumer.scrape()
    return {"t": round(el, 1),
            "published": sum(p.metric("rlstream_published_records_total") for p in soak.producers),
            "lag": metric_value(text, "rlstream_consumer_lag_records"),
            "version": metric_value(text, "rlstream_consumer_policy_version"),
            "rss": {s.name: group_rss_bytes(s.pid) for s in soak.services}}


# ---------------------------------------------------------------------------- drain

def drain(soak: Soak) -> None:
    """Producers finish and flush, the consumer reads everything and stops; final counters."""
    from rlstream.harness.supervisor import wait_until
    from tests.support.feeder import flush_half_batch

    c = soak.consumer
    for p in soak.producers:
        assert p.stop(timeout_s=180) == 0, p.log_tail()
        soak.published += int(p.final()["published"])
    wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0
               and c.try_metric("rlstream_consumer_open_groups") == 0, 300, "drained", [c], interval_s=0.5)
    flush_half_batch(soak.kafka, soak.ckpt, c, soak.args.group_size, soak.args.groups_per_batch,
                     on_publish=soak.fillers.extend)
    wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0, 60, "drained", [c])
    assert c.stop(timeout_s=180) == 0, c.log_tail()
    soak.outcomes = c.final()["outcomes"]


# ---------------------------------------------------------------------------- report

def report(soak: Soak) -> dict:
    from tests.support.audit import audit_steps

    out, samples, args = soak.outcomes, soak.samples, soak.args
    trained_ids = [rid for ids in audit_steps(soak.ckpt).values() for rid in ids]
    total = soak.published + len(soak.fillers)
    accounted = out["trained"] + out["dropped_stale"] + out["timed_out"] + out["dlq"]
    waits = step_waits(soak.waits["start"], soak.waits["end"])
    lags = [x["lag"] for x in samples]
    rss = rss_growth(samples, [s.name for s in soak.services])
    return {
        "bench": "soak", "smoke": args.smoke, "duration_s": round(soak.run_s, 1), "producers": args.producers,
        "G": args.group_size, "B": args.groups_per_batch,
        "records_per_s": round(samples[-1]["published"] / soak.run_s, 2) if samples else 0.0,
        "published": total, "trained": int(out["trained"]), "dropped_stale": int(out["dropped_stale"]),
        "timed_out": int(out["timed_out"]), "dlq": int(out["dlq"]), "duplicate": int(out["duplicate"]),
        "lost": int(total - accounted), "trained_twice": len(trained_ids) - len(set(trained_ids)),
        "steps": max(audit_steps(soak.ckpt), default=0),
        "lag_records": {"max": max(lags, default=0), "mean": round(statistics.fmean(lags), 1) if lags else 0,
                        "last": lags[-1] if lags else 0},
        "rss_mb": rss,
        "memory_flat": all(v["growth_pct"] is not None and v["growth_pct"] < 10 for v in rss.values()),
        "step_wait_s": waits,
        "stall_free": waits["steps"] > 0 and waits["over_10s"] == 0,
        "staleness_changes": soak.staleness_changes,
        "timeline": [{"t": x["t"], "published": x["published"], "lag": x["lag"], "version": x["version"],
                      "rss_mb": {k: round(v / 2**20) for k, v in x["rss"].items()}} for x in samples],
        "work_dir": str(soak.tmp),
    }


def step_waits(start: dict[float, float], end: dict[float, float]) -> dict:
    """Steps of the run, their mean wait, how many waited over 10 s, and the bucket
    bounds the longest and the 99th-percentile wait are within."""
    cum = {le: end[le] - start.get(le, 0.0) for le in sorted(end)}
    steps = cum.get(float("inf"), 0.0)
    bound = lambda q: next((le for le, n in cum.items() if n >= q * steps), None) if steps else None  # noqa: E731
    return {"steps": int(steps), "over_10s": int(steps - cum.get(10.0, 0.0)),
            "max_le": bound(1.0), "p99_le": bound(0.99)}


def rss_growth(samples: list[dict], names: list[str]) -> dict:
    """Per service: first- vs last-third medians, and the last sixth vs the sixth after the midpoint."""
    n, third = len(samples), max(1, len(samples) // 3)
    out = {}
    for name in names:
        first = statistics.median(x["rss"][name] for x in samples[1:third + 1] or samples[:1])
        last = statistics.median(x["rss"][name] for x in samples[-third:])
        mid = statistics.median(x["rss"][name] for x in samples[n // 2:n // 2 + max(1, n // 6)] or samples[-1:])
        end = statistics.median(x["rss"][name] for x in samples[-max(1, n // 6):])
        out[name] = {"first_third_mb": round(first / 2**20, 1), "last_third_mb": round(last / 2**20, 1),
                     "growth_pct": round(100 * (last - first) / first, 1) if first else None,
                     "late_growth_pct": round(100 * (end - mid) / mid, 1) if mid else None}
    return out


# ---------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0, help="run time before the drain (default 600)")
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-per-batch", type=int, default=2)
    ap.add_argument("--work-dir", default=None, help="keep logs here (default: a temp dir)")
    args = parse_args(ap, SMOKE)

    import logging

    logging.basicConfig(level=logging.WARNING)
    soak = setup(args)
    try:
        warm(soak)
        measure(soak)
        drain(soak)
    finally:
        for s in soak.services:
            if s.alive:
                s.kill()
        soak.broker.stop()
    result = report(soak)
    print(json.dumps(result))
    ok = result["lost"] == 0 and result["trained_twice"] == 0 and result["stall_free"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
