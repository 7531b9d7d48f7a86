"""Soak run (issue #8.7): several vLLM producers at full speed, one consumer, max_staleness changes.

    .venv/bin/python tests/bench/soak.py                   # ~10 minutes, 3 producers
    .venv/bin/python tests/bench/soak.py --duration-s 120 --producers 2

Not part of the test run (tests/bench is ignored by pytest). Starts its own
tansu broker on loopback, builds the tiny model, runs the real services as
subprocesses (tests/services.py), changes `max_staleness` through the
consumer's admin API at 1/3 and 2/3 of the run, and samples every
`--sample-s` seconds: records published, consumer outcomes and lag, and the
resident memory of every service (process group). At the end the producers
drain (SIGTERM: every finished sample acknowledged), the consumer reads
everything, a filler group flushes a possible half batch, and the consumer
stops cleanly. Prints ONE JSON object:

    records_per_s            published records / run seconds
    lag_records              {max, mean, last} of the consumer's lag gauge
    rss_mb                   per service: first-third and last-third medians, growth %,
                             and late_growth_pct: last sixth vs the sixth after the midpoint
                             (warm-up allocations excluded: a leak keeps growing here)
    memory_flat              every service grew < 10 % first vs last third
    step_wait_s              {max, p99, steps}: the consumer's wait for data per global step
                             during the run (step 1, the engines' start, and the drain excluded)
    stall_free               no step waited more than 10 s (a backpressure deadlock shows here)
    published / trained / dropped_stale / timed_out / dlq / duplicate
    lost                     published - (trained + dropped_stale + timed_out + dlq); must be 0
    trained_twice            rollout ids in the audit log more than once; must be 0
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0, help="run time before the drain (default 600)")
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-per-batch", type=int, default=2)
    ap.add_argument("--work-dir", default=None, help="keep logs here (default: a temp dir)")
    args = ap.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    from common.kafka.broker import EmbeddedBroker
    from common.config import BrokerSettings
    from common.toy.tinymodel import build_tiny_model
    from fixtures_kafka import make_kafka_settings
    from services import (ADMIN_TOKEN, Service, audit_steps, ensure_prompts, final_outcomes, flush_half_batch,
                          group_rss_bytes, http_request, metric_value, service_config, wait_until, write_config)

    G, B = args.group_size, args.groups_per_batch
    tmp = Path(args.work_dir or tempfile.mkdtemp(prefix="rlstream-soak-"))
    tmp.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(tmp / "tiny-model")
    broker = EmbeddedBroker(BrokerSettings(port=0)).start()
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
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
    ckpt = Path(cfg.consumer.checkpoint_dir)
    services = [consumer, *producers]
    samples, staleness_changes = [], []
    try:
        consumer.start()
        for p in producers:
            p.start()
        for s in services:
            s.wait_http(600)
        wait_until(lambda: max(audit_steps(ckpt), default=0) >= 1, 600, "the first step", services)
        t0 = time.monotonic()
        plan = [(args.duration_s / 3, 4), (2 * args.duration_s / 3, 1)]
        while (el := time.monotonic() - t0) < args.duration_s:
            if plan and el >= plan[0][0]:
                _, value = plan.pop(0)
                code, body = http_request(consumer.url + "/admin/control", "POST",
                                          {"key": "max_staleness", "value": value}, token=ADMIN_TOKEN)
                staleness_changes.append({"at_s": round(el, 1), "value": value, "http": code})
            text = consumer.scrape()
            samples.append({
                "t": round(el, 1),
                "published": sum(p.metric("rlstream_published_records_total") for p in producers),
                "lag": metric_value(text, "rlstream_consumer_lag_records"),
                "version": metric_value(text, "rlstream_consumer_policy_version"),
                "rss": {s.name: group_rss_bytes(s.pid) for s in services},
            })
            for s in services:
                assert s.alive, f"{s.name} died:\n{s.log_tail()}"
            time.sleep(args.sample_s)
        run_s = time.monotonic() - t0
        run_log_lines = len(consumer.log_text().splitlines())  # the drain's waits are not the run's

        # drain: producers finish and flush, the consumer reads everything
        published = 0
        for p in producers:
            assert p.stop(timeout=180) == 0, p.log_tail()
            line = [ln for ln in p.log_text().splitlines() if "producer drained: published=" in ln]
            published += int(line[-1].split("published=")[1].split()[0])
        wait_until(lambda: consumer.try_metric("rlstream_consumer_lag_records") == 0
                   and consumer.try_metric("rlstream_consumer_open_groups") == 0, 300, "drained", [consumer],
                   interval=0.5)
        fillers = []
        flush_half_batch(kafka, ckpt, consumer, G, B, on_publish=fillers.extend)
        wait_until(lambda: consumer.try_metric("rlstream_consumer_lag_records") == 0, 60, "drained", [consumer])
        assert consumer.stop(timeout=180) == 0, consumer.log_tail()
        out = final_outcomes(consumer.log_text())
    finally:
        for s in services:
            if s.alive:
                s.kill()
        broker.stop()

    trained_ids = [rid for ids in audit_steps(ckpt).values() for rid in ids]
    total = published + len(fillers)
    accounted = out["trained"] + out["dropped_stale"] + out["timed_out"] + out["dlq"]
    third = max(1, len(samples) // 3)
    rss = {}
    for s in services:
        first = statistics.median(x["rss"][s.name] for x in samples[1:third + 1] or samples[:1])
        last = statistics.median(x["rss"][s.name] for x in samples[-third:])
        rss[s.name] = {"first_third_mb": round(first / 2**20, 1), "last_third_mb": round(last / 2**20, 1),
                       "growth_pct": round(100 * (last - first) / first, 1) if first else None}
    for s in services:
        n = len(samples)
        mid = statistics.median(x["rss"][s.name] for x in samples[n // 2:n // 2 + max(1, n // 6)] or samples[-1:])
        end = statistics.median(x["rss"][s.name] for x in samples[-max(1, n // 6):])
        rss[s.name]["late_growth_pct"] = round(100 * (end - mid) / mid, 1) if mid else None
    # step 1 waits for the producers' engines to start: not part of the run
    waits = sorted(float(m.group(2)) for ln in consumer.log_text().splitlines()[:run_log_lines]
                   if (m := re.search(r" step=(\d+) .* wait=([0-9.]+)s", ln)) and int(m.group(1)) > 1)
    lags = [x["lag"] for x in samples]
    result = {
        "bench": "soak", "duration_s": round(run_s, 1), "producers": args.producers, "G": G, "B": B,
        "records_per_s": round(samples[-1]["published"] / run_s, 2) if samples else 0.0,
        "published": total, "trained": int(out["trained"]), "dropped_stale": int(out["dropped_stale"]),
        "timed_out": int(out["timed_out"]), "dlq": int(out["dlq"]), "duplicate": int(out["duplicate"]),
        "lost": int(total - accounted), "trained_twice": len(trained_ids) - len(set(trained_ids)),
        "steps": max(audit_steps(ckpt), default=0),
        "lag_records": {"max": max(lags, default=0), "mean": round(statistics.fmean(lags), 1) if lags else 0,
                        "last": lags[-1] if lags else 0},
        "rss_mb": rss,
        "memory_flat": all(v["growth_pct"] is not None and v["growth_pct"] < 10 for v in rss.values()),
        "step_wait_s": {"max": waits[-1] if waits else None,
                        "p99": waits[int(0.99 * (len(waits) - 1))] if waits else None, "steps": len(waits)},
        "stall_free": bool(waits) and waits[-1] < 10,
        "staleness_changes": staleness_changes,
        "timeline": [{"t": x["t"], "published": x["published"], "lag": x["lag"], "version": x["version"],
                      "rss_mb": {k: round(v / 2**20) for k, v in x["rss"].items()}} for x in samples],
        "work_dir": str(tmp),
    }
    print(json.dumps(result))
    ok = result["lost"] == 0 and result["trained_twice"] == 0 and result["stall_free"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
