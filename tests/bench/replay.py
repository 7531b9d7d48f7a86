"""Replay and export benchmark: does a replay equal its run, how fast are replay and export,
and does export memory stay flat as the topic grows? Prints one JSON object (last stdout line).

    .venv/bin/python tests/bench/replay.py [--steps 40] [--groups-per-s 6] [--records 1400] [--reps 3] [--smoke]

`--smoke`: 4 steps, 60 / 240 small records, 1 MB row groups (seconds; the figures mean nothing).

Replay. Its own broker (tansu, free port), the tiny model, and the consumer
service's own loop in this process (`ConsumerService.run`, Megatron-core on
CPU) training `--steps` steps in reweight mode, with a staleness change
(decay) half-way; a generation stand-in in another process publishes
synthetic groups at `--groups-per-s`, as producers would. Then `rlstream
replay` (`consumer.logreplay.run.replay`, in this process) trains the same steps
from the log.

  replay_equal                 every step's metrics and every model and optimizer tensor equal (CPU)
  original_steps_per_s         steps after the first / seconds between the first and last audit line
  replay_steps_per_s           steps / seconds of the replay's step loop (reads and training; not start-up)
  replay_over_original         the ratio; goal >= 1: a replay never waits on generation

Export. `--records` records of production-like shape (1,024 response tokens,
routing of 8 layers x top-4 of 64 experts: ~46 KB each) on a topic, and four
times as many on another; each exported by `rlstream export` in a process of
its own (peak resident memory: VmHWM), `--row-group-mb` row groups, `--reps`
rounds per size, the raw read and the export in alternating order (the
machine is shared: a ratio is taken per round, the median round reported).

  export_mb_per_s              Kafka value MB / second of the export (read, decode, Parquet write, fsync;
                               the process's imports before it, `export_imports_s`, are not counted)
  raw_decode_mb_per_s          the same records read with the same reader and msgpack-decoded, nothing else
  export_over_raw_decode       the median round's ratio on the 4x topic (`_by_size`, `_rounds`: all); goal >= 0.5
  export_over_raw_decode_cpu   the same ratio per CPU-second (the export process's, start-up and
                               imports included; the raw read's process), median round: what other
                               tenants of a shared machine disturb far less than wall time
  export_peak_rss_mb           {1x, 4x}: the export process's peak resident memory
  export_memory_ratio          4x over 1x; flat is ~1 (goal <= 1.25)

stdout carries only the JSON; logs go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

log = logging.getLogger("bench.replay")
SMOKE = dict(steps=4, records=60, row_group_mb=1, part_mb=4, reps=1)
G, B = 4, 2


def _setup() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


# ------------------------------------------------------------------ replay

def generation(kafka_dump: dict, groups_per_s: float, stop) -> None:
    """The generation stand-in (its own process): version-0 groups at a steady rate."""
    import numpy as np

    from rlstream.common.config import KafkaSettings
    from rlstream.common.kafka.publisher import RolloutPublisher
    from tests.support.synthetic import synthetic_group

    rng, n = np.random.default_rng(0), 0
    with RolloutPublisher(KafkaSettings.model_validate(kafka_dump)) as pub:
        while not stop.is_set():
            for r in synthetic_group(f"gen-{n}", G, 0, rng, prompt_len=16, max_resp=16):
                pub.publish(r, timeout=60)
            n += 1
            stop.wait(1.0 / groups_per_s)


def bench_replay(args, broker, tmp: Path) -> dict:
    from rlstream.toy.tinymodel import build_tiny_model
    from rlstream.consumer.logreplay.run import replay
    from rlstream.consumer.service import ConsumerService
    from tests.fixtures.kafka import make_kafka_settings
    from tests.support.audit import audit_lines
    from tests.support.configs import service_config, trainer_writer

    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    cfg = service_config(kafka, build_tiny_model(tmp / "model"), tmp, G=G, B=B,
                         staleness={"max_staleness": 1000, "mode": "reweight", "decay": 0.99},
                         consumer={"max_steps": args.steps, "checkpoint": {"every_steps": 10}})
    ckpt = Path(cfg.consumer.checkpoint_dir)
    stop = mp.get_context("spawn").Event()
    gen = mp.get_context("spawn").Process(target=generation, args=(kafka.model_dump(), args.groups_per_s, stop))
    svc = ConsumerService(cfg, broker.bootstrap)
    seen: dict[int, float] = {}

    def watch() -> None:  # generation once the consumer is up; when each audit line appeared; the change
        changed = False
        while getattr(svc, "http", None) is None and not svc._stop:
            time.sleep(0.05)
        gen.start()
        while not svc._stop and len(seen) < args.steps:
            n = audit_lines(ckpt)
            for s in range(len(seen) + 1, n + 1):
                seen[s] = time.perf_counter()
            if not changed and n >= args.steps // 2:
                w = trainer_writer(kafka)  # services apply only signed control changes
                w.set_control("decay", 0.9, by="bench")
                w.close()
                changed = True
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        svc.run()
    finally:
        stop.set()
        watcher.join(10)
        if gen.is_alive() or gen.exitcode is not None:
            gen.join(60)
    original = (args.steps - 1) / max(seen[args.steps] - seen[1], 1e-9) if len(seen) == args.steps else None
    summary = replay(cfg, tmp / "replayed").as_dict()
    ratio = summary["steps_per_s"] / original if original else None
    return {"replay_equal": summary["replay_equal"], "steps": args.steps,
            "original_steps_per_s": round(original, 3) if original else None,
            "replay_steps_per_s": summary["steps_per_s"], "replay_over_original": round(ratio, 3) if ratio else None,
            "replay_summary": summary}


# ------------------------------------------------------------------ export

DISTINCT = 256
"""Distinct records a topic cycles through (~12 MB: beyond zstd's window and a dictionary page, so
the Parquet writer compresses nothing it would not compress on a real topic)."""


def fill_topic(kafka, n: int) -> int:
    """`n` records of production-like shape (group ids do not matter to an export)."""
    from rlstream.common.kafka.publisher import RolloutPublisher
    from rlstream.common.record import encode
    from tests.fixtures.kafka import realistic_rollout

    values = [encode(realistic_rollout(response_tokens=1024, prompt_tokens=128, layers=8, top_k=4, num_experts=64,
                                       vocab=151_936, group_size=1, seed=i)) for i in range(min(n, DISTINCT))]
    with RolloutPublisher(kafka) as pub:
        futs = [pub.publish_bytes(f"g-{i}".encode(), values[i % len(values)], timeout=60) for i in range(n)]
        for f in futs:
            f.result(timeout=120)
    return len(values[0])


def raw_decode(kafka) -> tuple[float, float, float]:
    """MB/s reading the topic with the export's reader and msgpack-decoding each value; MB/s of the
    decode alone; MB per CPU-second of the read (this process: its kafka-python threads too)."""
    import msgpack

    from rlstream.common.kafka.scan import TopicScan

    nbytes, decode_s = 0, 0.0
    t0, cpu0 = time.perf_counter(), time.process_time()
    with TopicScan(kafka, kafka.topics.rollouts) as scan:
        while not all(scan.done(p) for p in scan.partitions):
            for m in scan.poll(only={p for p in scan.partitions if not scan.done(p)}):
                t1 = time.perf_counter()
                msgpack.unpackb(m.value, raw=False)
                decode_s += time.perf_counter() - t1
                nbytes += len(m.value)
    return (nbytes / 1e6 / (time.perf_counter() - t0), nbytes / 1e6 / max(decode_s, 1e-9),
            nbytes / 1e6 / (time.process_time() - cpu0))


def export_process(config: Path, out: Path, args) -> dict:
    """`rlstream export` in a process of its own: its summary and peak resident memory (MB)."""
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the forking parent (this
    # bench, with Megatron loaded), while exec gives the child a fresh high-water mark
    # the imports first, timed apart: pyarrow imports pandas (when installed) on its first array,
    # ~1-2 s once per process, which would otherwise land in the first row group's time
    code = ("import json, re, sys, time\nt = time.perf_counter()\nfrom rlstream.cli import main\n"
            "import pyarrow.parquet, rlstream.common.export.run\ntry:\n    import pandas\nexcept ImportError:\n    pass\n"
            "imports = time.perf_counter() - t\ncpu = time.process_time()\n"
            "rc = main(sys.argv[1:])\ncpu = time.process_time() - cpu\n"
            "hwm = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "print(json.dumps({'rc': rc, 'maxrss_mb': hwm / 1024, 'cpu_s': cpu, 'imports_s': imports}))")
    argv = [sys.executable, "-c", code, "export", "-c", str(config), "--out", str(out),
            "--row-group-mb", str(args.row_group_mb), "--part-mb", str(args.part_mb)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or len(lines) < 2:
        raise RuntimeError(f"export failed ({p.returncode}): {p.stderr[-3000:]}")
    return {**json.loads(lines[-2]), **json.loads(lines[-1])}


def bench_export(args, broker, tmp: Path) -> dict:
    """Per topic size, `--reps` rounds of (raw read + decode, export in its own process), the two
    in alternating order; the ratio per round, its median per size; the peak memory, the highest."""
    import yaml

    from rlstream.common.config import RlstreamConfig
    from tests.fixtures.kafka import make_kafka_settings

    tmp.mkdir(parents=True, exist_ok=True)
    keys = ("export_peak_rss_mb", "export_mb_per_s", "raw_decode_mb_per_s", "decode_only_mb_per_s",
            "export_over_raw_decode_by_size", "export_over_raw_decode_rounds", "export_over_raw_decode_cpu")
    out: dict = {"record_bytes": None, **{k: {} for k in keys}}
    for scale in (1, 4):
        key = f"{scale}x"
        kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=4)
        out["record_bytes"] = fill_topic(kafka, args.records * scale)
        config = tmp / f"export-{key}.yaml"
        config.write_text(yaml.safe_dump(RlstreamConfig.model_validate({"kafka": kafka.model_dump()})
                                         .model_dump(mode="json")))
        rounds = []
        for rep in range(args.reps):
            if rep % 2:
                r = export_process(config, tmp / f"out-{key}-{rep}", args)
                raw, decode_only, raw_cpu = raw_decode(kafka)
            else:
                raw, decode_only, raw_cpu = raw_decode(kafka)
                r = export_process(config, tmp / f"out-{key}-{rep}", args)
            cpu_ratio = r["value_bytes"] / 1e6 / r["cpu_s"] / raw_cpu
            rounds.append((r["value_mb_per_s"] / raw, r, raw, decode_only, cpu_ratio))
        ratio, r, raw, decode_only, _ = sorted(rounds, key=lambda x: x[0])[len(rounds) // 2]  # the median round
        out["export_over_raw_decode_rounds"][key] = [round(x[0], 3) for x in rounds]
        out["export_over_raw_decode_cpu"][key] = round(sorted(x[4] for x in rounds)[len(rounds) // 2], 3)
        out["export_over_raw_decode_by_size"][key] = round(ratio, 3)
        out["export_mb_per_s"][key], out["raw_decode_mb_per_s"][key] = r["value_mb_per_s"], round(raw, 1)
        out["decode_only_mb_per_s"][key] = round(decode_only, 1)
        out["export_peak_rss_mb"][key] = round(max(x[1]["maxrss_mb"] for x in rounds), 1)
        out["export_imports_s"] = round(r["imports_s"], 2)
        out[f"topic_mb_{key}"] = round(r["value_bytes"] / 1e6, 1)
    # the 4x topic: the export's own start (its Kafka clients, the first fetch) weighs less there
    out["export_over_raw_decode"] = out["export_over_raw_decode_by_size"]["4x"]
    rss = out["export_peak_rss_mb"]
    out["export_memory_ratio"] = round(rss["4x"] / rss["1x"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--groups-per-s", type=float, default=6.0, help="the generation stand-in's rate")
    ap.add_argument("--records", type=int, default=1400, help="records of the 1x export topic (~46 KB each)")
    ap.add_argument("--row-group-mb", type=int, default=8)
    ap.add_argument("--part-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="rounds of raw read vs export per topic size")
    args = parse_args(ap, SMOKE)
    _setup()
    from rlstream.common.config import BrokerSettings
    from rlstream.common.kafka.broker import EmbeddedBroker

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as d:
        broker = EmbeddedBroker(BrokerSettings(port=0)).start()
        try:
            rep = bench_replay(args, broker, Path(d) / "replay")
            exp = bench_export(args, broker, Path(d) / "export")
        finally:
            broker.stop()
    ratio = rep["replay_over_original"]
    result = {
        "replay_equal": rep["replay_equal"], "replay_over_original": ratio, **{k: v for k, v in rep.items()
                                                                              if k not in ("replay_equal",)},
        **exp, "smoke": args.smoke,
        "targets_met": {"replay_equal": rep["replay_equal"], "replay_over_original": ratio is not None and ratio >= 1,
                        "export_over_raw_decode": exp["export_over_raw_decode"] >= 0.5,
                        "export_memory_flat": exp["export_memory_ratio"] <= 1.25},
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "command": " ".join(["tests/bench/replay.py", *sys.argv[1:]]),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
