"""Consumer benchmark (issue #5): does the trainer wait for data, and what do checkpoints and weight
publishing cost? Prints one JSON object.

    .venv/bin/python tests/bench/consumer.py [--steps 60] [--threads 1] [--pipeline-seconds 60 | --no-pipeline
                                             | --pipeline-json FILE] [--smoke]

`--smoke`: 4 steps of 2 groups x 4, a ~38 MB "large" model (4 experts), no real pipeline (seconds).

Two answers to "does the trainer wait", because they differ by 20x:

1. Synthetic feed (the trainer's own cost of waiting). Starts its own broker
   (tansu, free port), a real in-process `ConsumerService` on the tiny model
   (Megatron-core, CPU) and a synthetic producer in a separate process that
   keeps the rollouts topic full: it publishes `synthetic_group` records
   (stamped with the trainer's current version) whenever fewer than
   `--ahead-batches` global batches are waiting past the consumer's read
   position. The consumer runs the service's loop by hand, timing each phase of
   every global step:  next_batch (with its control catch-up) -> train_step ->
   checkpoint -> publish_weights
2. Real pipeline (what a user sees). `rlstream experiment async` with one run
   per arm (`--pipeline-seconds` each; sync: max_staleness 0, async:
   max_staleness 2): broker, vLLM producer and Megatron consumer as processes;
   the share is the consumer's `wait` phase over its whole step
   (`rlstream_consumer_step_phase_seconds`, steady part of each run). Or read
   from the JSON a previous `rlstream experiment async` printed
   (`--pipeline-json`, its last line), or skipped (`--no-pipeline`).

  consumer_wait_share  (1) next_batch seconds / step seconds (all phases), median
                       over `--repeats` blocks of steps; target <= 0.05. All of
                       next_batch counts as waiting, including decoding,
                       group assembly, gating, the control catch-up and the
                       per-poll lag query (broken down in `next_batch_breakdown`),
                       so the figure is an upper bound on time spent starved of data.
  consumer_wait_share_pipeline  (2) per arm; `pipeline` has its source, seconds and phases.
  checkpoint_seconds   ConsumerService.checkpoint: what the loop waits for when a checkpoint is due
                       (consumer.checkpoint cadence; the snapshot, the write goes on in the background)
  publish_seconds      ConsumerService.publish_weights on the configured weight path
                       (`weights_transport`; collective, the default: export + pack + hash
                       of the snapshot and the announcement; its durable copy is written in
                       the background every `consumer.weights.durable_every` versions).
  model_bytes          bytes of one durable copy of the tiny model (WeightStore.write).
  publish_breakdown    export / WeightStore.write / announcement, timed apart (the file path).
  large.*              WeightStore.write + announcement of a ~215 MB Qwen3-MoE
                       state dict (TinyModelSpec: hidden 512, 4 layers, 32 experts,
                       built with build_tiny_model) and a checkpoint of it with
                       AdamW-sized optimizer state (3x the weights) through
                       consumer.checkpoint.CheckpointManager.

stdout carries only the JSON; logs go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

log = logging.getLogger("bench.consumer")

LARGE_SPEC = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                  num_experts_per_tok=4)
SMOKE = dict(steps=4, repeats=2, warmup=1, group_size=4, groups_per_batch=2, large_experts=4, no_pipeline=True)
PHASES = ("wait", "train", "checkpoint", "publish")


def _setup(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _med(xs) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------------
# the synthetic producer (its own process: no GIL or core shared with the trainer loop)
# ---------------------------------------------------------------------------
def synthetic_producer(kafka_dump: dict, G: int, ahead_records: int, prompt_len: int, max_resp: int,
                       read_pos, version, published, stop) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np

    from rlstream.common.config import KafkaSettings
    from rlstream.common.kafka.publisher import RolloutPublisher
    from tests.support.synthetic import synthetic_group

    kafka = KafkaSettings.model_validate(kafka_dump)
    rng = np.random.default_rng(0)
    n = 0
    with RolloutPublisher(kafka) as pub:
        while not stop.is_set():
            if published.value - read_pos.value >= ahead_records:
                time.sleep(0.005)
                continue
            for r in synthetic_group(f"syn-{n}", G, int(version.value), rng, prompt_len=prompt_len,
                                     max_resp=max_resp):
                pub.publish(r, timeout=60)
            n += 1
            with published.get_lock():
                published.value += G


# ---------------------------------------------------------------------------
# the consumer loop, phase by phase
# ---------------------------------------------------------------------------
class _Timed:
    """Wraps a bound method and accumulates its wall time (next_batch breakdown)."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def run_steps(svc, n: int, read_pos, version) -> list[dict]:
    poll, lag = _Timed(svc.reader.poll), _Timed(svc.reader.lag)
    svc.reader.poll, svc.reader.lag = poll, lag  # instance attributes: the service calls these
    steps = []
    for _ in range(n):
        p0, p1, l0, l1 = poll.seconds, poll.calls, lag.seconds, lag.calls
        t0 = t1 = time.perf_counter()
        batch = svc.next_batch()  # its batch boundary catches the control topic up, as in the service
        t2 = time.perf_counter()
        # staleness as docs/algorithm.md defines it: trainer version at this optimizer step - oldest token version
        v_step = svc.version
        train_staleness = max(v_step - r.oldest_version for rg in batch for r in rg.group.rollouts())
        m = svc.train_step(batch)
        t3 = time.perf_counter()
        svc.checkpoint()
        t4 = time.perf_counter()
        svc.publish_weights()
        t5 = time.perf_counter()
        read_pos.value = sum(svc.reader.positions().values())
        version.value = svc.version
        s = dict(zip(PHASES, (t2 - t1, t3 - t2, t4 - t3, t5 - t4)))
        s.update(total=t5 - t0, poll=poll.seconds - p0, polls=poll.calls - p1, lag=lag.seconds - l0,
                 lag_calls=lag.calls - l1, compute=m["time_forward"] + m["time_backward"] + m["time_optimizer"],
                 gate_staleness=max(rg.staleness for rg in batch), train_staleness=train_staleness)
        steps.append(s)
        log.info("step %d: " + " ".join(f"{k}=%.3f" for k in PHASES) + " polls=%d", svc.step,
                 *(s[k] for k in PHASES), s["polls"])
    return steps


def publish_breakdown(svc, ann_producer, tmp: Path, repeats: int) -> dict:
    """export_hf_state_dict / WeightStore.write / announcement, timed apart (store of our own)."""
    from rlstream.common.weights.store import WeightStore

    store = WeightStore(tmp / "bench-weights", keep=2)
    ex, wr, an = [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        sd = svc.leader.trainer.export_hf_state_dict()
        t1 = time.perf_counter()
        m = store.write(i + 1, sd, svc.cfg.model.path)
        t2 = time.perf_counter()
        announce(ann_producer, svc.kafka.topics.policy + ".bench", m)
        t3 = time.perf_counter()
        ex.append(t1 - t0), wr.append(t2 - t1), an.append(t3 - t2)
    return {"export_seconds": round(_med(ex), 4), "store_write_seconds": round(_med(wr), 4),
            "announce_seconds": round(_med(an), 4), "model_bytes": m["bytes"]}


def announcement_producer(kafka):
    """Our own KafkaProducer for timing announcements (as the service's: acks=all), on a side topic."""
    from kafka import KafkaProducer

    from rlstream.common.kafka.client import client_kwargs

    return KafkaProducer(**client_kwargs(kafka), acks="all")


def announce(producer, topic: str, m: dict) -> None:
    from rlstream.common.control.messages import WeightsReady

    ann = WeightsReady(version=m["version"], transport="file", uri=m["uri"], sha256=m["sha256"], bytes=m["bytes"])
    producer.send(topic, key=ann.kind.encode(), value=ann.model_dump_json().encode()).get(timeout=30)


def large_publish_and_checkpoint(svc, ann_producer, tmp: Path, repeats: int, experts: int) -> dict:
    """WeightStore.write + announcement, and a checkpoint, of a ~215 MB model (32 experts)."""
    import torch
    from safetensors.torch import load_file

    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from rlstream.common.weights.store import WeightStore
    from rlstream.consumer.checkpoint.files import CheckpointManager, CheckpointState

    t0 = time.perf_counter()
    spec = {**LARGE_SPEC, "num_experts": experts,
            "num_experts_per_tok": min(experts, LARGE_SPEC["num_experts_per_tok"])}
    d = build_tiny_model(tmp / "large-model", TinyModelSpec(**spec))
    sd = load_file(str(d / "model.safetensors"))
    build_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    store = WeightStore(tmp / "large-weights", keep=1)
    write_s, ann_s = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        m = store.write(i + 1, sd, d)
        t1 = time.perf_counter()
        announce(ann_producer, svc.kafka.topics.policy + ".bench", m)
        write_s.append(t1 - t0), ann_s.append(time.perf_counter() - t1)
    optim = {"exp_avg": {k: torch.zeros_like(v) for k, v in sd.items()},
             "exp_avg_sq": {k: torch.zeros_like(v) for k, v in sd.items()}}
    ckpt = CheckpointManager(tmp / "large-ckpt", keep=1)
    ck_s = []
    for i in range(repeats):
        st = CheckpointState(i + 1, i + 1, {0: 0, 1: 0}, [], {})
        t0 = time.perf_counter()
        ckpt.save(st, {"model": sd, "optimizer": optim, "step": i + 1})
        ck_s.append(time.perf_counter() - t0)
    ck_bytes = sum(f.stat().st_size for f in ckpt._complete()[-1].iterdir())
    pub = _med(write_s) + _med(ann_s)
    return {"spec": spec, "model_bytes": m["bytes"], "tensor_bytes": nbytes,
            "publish_seconds": round(pub, 4), "store_write_seconds": round(_med(write_s), 4),
            "announce_seconds": round(_med(ann_s), 4), "publish_mb_per_s": round(m["bytes"] / 1e6 / pub, 1),
            "checkpoint_seconds": round(_med(ck_s), 4), "checkpoint_bytes": ck_bytes,
            "checkpoint_mb_per_s": round(ck_bytes / 1e6 / _med(ck_s), 1),
            "model_build_seconds": round(build_s, 1), "repeats": repeats}


# ---------------------------------------------------------------------------
# main: setup -> warm -> measure -> report
# ---------------------------------------------------------------------------
@dataclass
class Bench:
    """What setup builds (each field set as soon as it exists, so teardown closes it)."""

    tmp: Path
    read_pos: object = None  # shared with the synthetic producer process
    version: object = None
    published: object = None
    stop: object = None
    broker: object = None
    prod: object = None
    cfg: object = None
    svc: object = None


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60, help="measured global steps (split into --repeats blocks)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=10)
    ap.add_argument("--max-resp", type=int, default=8, help="synthetic response length bound (demo max_tokens)")
    ap.add_argument("--ahead-batches", type=int, default=3, help="batches the producer keeps on the topic")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (consumer.num_threads)")
    ap.add_argument("--no-large", action="store_true")
    ap.add_argument("--large-experts", type=int, default=LARGE_SPEC["num_experts"],
                    help="experts of the large model (32: ~215 MB; 4: ~38 MB)")
    ap.add_argument("--pipeline-seconds", type=float, default=60.0,
                    help="RL seconds per arm of the real-pipeline measurement (rlstream experiment async, 1 rep)")
    ap.add_argument("--pipeline-json", help="take the real-pipeline figure from this `rlstream experiment "
                    "async` output (its last line) instead of running it")
    ap.add_argument("--no-pipeline", action="store_true", help="synthetic feed only")
    ap.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"),
                    help="config of the real-pipeline runs")
    return parse_args(ap, SMOKE)


def setup(args, b: Bench) -> None:
    """Broker, topics, the synthetic producer process, the tiny model, a started ConsumerService."""
    import multiprocessing as mp

    import torch

    from rlstream.common.config import BrokerSettings, RlstreamConfig
    from rlstream.common.kafka.broker import EmbeddedBroker
    from rlstream.toy.tinymodel import build_tiny_model
    from rlstream.consumer.service import ConsumerService
    from tests.fixtures.kafka import make_kafka_settings

    G, B = args.group_size, args.groups_per_batch
    ctx = mp.get_context("spawn")
    b.read_pos, b.version, b.published = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)
    b.stop = ctx.Event()
    b.broker = EmbeddedBroker(BrokerSettings(port=0)).start()
    kafka = make_kafka_settings(b.broker.bootstrap, b.tmp / "blobs", rollouts_partitions=2)
    b.prod = ctx.Process(target=synthetic_producer, daemon=True,
                         args=(kafka.model_dump(), G, args.ahead_batches * B * G, args.prompt_len,
                               args.max_resp, b.read_pos, b.version, b.published, b.stop))
    b.prod.start()
    model_dir = build_tiny_model(b.tmp / "tiny")
    b.cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(model_dir), "build_tiny": False},
        "staleness": {"max_staleness": args.ahead_batches + 2, "mode": "drop"},
        "producer": {"group_size": G},
        "consumer": {"group_size": G, "groups_per_batch": B, "num_threads": args.threads, "optimizer": {"lr": 1e-4},
                     "checkpoint_dir": str(b.tmp / "ckpt"), "weight_store_dir": str(b.tmp / "weights"),
                     "group_timeout_s": 60.0}})
    b.svc = ConsumerService(b.cfg, b.broker.bootstrap)
    b.svc.start()
    torch.set_num_threads(args.threads)


def warm(args, b: Bench) -> None:
    """The topic full before anything is timed, then `--warmup` steps."""
    deadline = time.monotonic() + 60
    while b.published.value < args.ahead_batches * args.groups_per_batch * args.group_size:
        assert b.prod.is_alive() and time.monotonic() < deadline, "synthetic producer did not fill the topic"
        time.sleep(0.05)
    run_steps(b.svc, args.warmup, b.read_pos, b.version)


def measure(args, b: Bench) -> dict:
    """The measured steps, then (producer stopped) the publish breakdown and the large model."""
    steps = run_steps(b.svc, args.steps, b.read_pos, b.version)
    b.stop.set()
    svc = b.svc
    ann_producer = announcement_producer(svc.kafka)
    try:
        breakdown = publish_breakdown(svc, ann_producer, b.tmp, repeats=3)
        large = None if args.no_large else large_publish_and_checkpoint(svc, ann_producer, b.tmp, repeats=2,
                                                                         experts=args.large_experts)
    finally:
        ann_producer.close(timeout=10)
    # The model's bytes from the breakdown's own durable copy: the service's store holds
    # only every `durable_every`-th version on the collective path, maybe none of these.
    return {"steps": steps, "tiny_bytes": breakdown["model_bytes"], "breakdown": breakdown, "large": large,
            "outcomes": {k: int(v) for k, v in svc.ledger.counters.items()}}


def report(args, b: Bench, m: dict, t_start: float, load0: float) -> dict:
    steps, B, G = m["steps"], args.groups_per_batch, args.group_size
    per = max(1, len(steps) // args.repeats)
    blocks = [steps[i:i + per] for i in range(0, per * args.repeats, per)]
    share = lambda ss, k: sum(s[k] for s in ss) / sum(s["total"] for s in ss)  # noqa: E731
    return {
        "bench": "consumer", "date": time.strftime("%Y-%m-%d"),
        "model": "tiny-qwen3-moe (2 layers, 8 experts, top-2), fp32, Megatron-core CPU",
        "consumer_wait_share": round(_med([share(b_, "wait") for b_ in blocks]), 4),
        "consumer_wait_share_blocks": [round(share(b_, "wait"), 4) for b_ in blocks],
        "phase_share": {k: round(share(steps, k), 4) for k in PHASES},
        "phase_seconds_median": {k: round(_med([s[k] for s in steps]), 4) for k in PHASES},
        "step_seconds_median": round(_med([s["total"] for s in steps]), 4),
        "next_batch_breakdown": {  # shares of all step time
            "reader_poll_share": round(share(steps, "poll"), 4),
            "lag_query_share": round(share(steps, "lag"), 4),
            "polls_per_step_mean": round(sum(s["polls"] for s in steps) / len(steps), 2),
            "steps_without_poll": sum(1 for s in steps if not s["polls"])},
        "train_compute_share": round(sum(s["compute"] for s in steps) / sum(s["total"] for s in steps), 4),
        "checkpoint_seconds": round(_med([s["checkpoint"] for s in steps]), 4),
        "publish_seconds": round(_med([s["publish"] for s in steps]), 4),
        "model_bytes": m["tiny_bytes"],
        "weights_transport": b.cfg.consumer.weights.transport,
        "publish_breakdown": m["breakdown"],
        "large": m["large"],
        "samples_per_second": round(len(steps) * B * G / sum(s["total"] for s in steps), 1),
        "max_staleness_gate": max(s["gate_staleness"] for s in steps),
        "max_staleness_at_train": max(s["train_staleness"] for s in steps),
        "max_staleness_setting": b.cfg.staleness.max_staleness,
        "outcomes": m["outcomes"],
        "workload": {"group_size": G, "groups_per_batch": B, "prompt_len": args.prompt_len,
                     "max_resp": args.max_resp, "ahead_batches": args.ahead_batches,
                     "steps": len(steps), "repeats": args.repeats, "warmup": args.warmup},
        "threads": args.threads, "smoke": args.smoke, "bench_seconds": round(time.perf_counter() - t_start, 1),
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],  # start, end: 2 cores, shared
    }


# ---------------------------------------------------------------------------
# the real pipeline (broker, vLLM producer, Megatron consumer as processes)
# ---------------------------------------------------------------------------
def pipeline_wait_shares(experiment: dict) -> dict[str, float]:
    """{arm: consumer wait seconds / step seconds} from `rlstream experiment async`'s JSON."""
    out = {}
    for arm, m in (experiment.get("arms") or {}).items():
        ph = m.get("phases") or {}
        if ph.get("c_wait") is not None and ph.get("c_step"):
            out[arm] = round(ph["c_wait"] / ph["c_step"], 4)
    return out


def real_pipeline(args) -> dict | None:
    """The async experiment's consumer wait shares (run now, or read from --pipeline-json)."""
    if args.no_pipeline:
        return None
    if args.pipeline_json:
        text, source = Path(args.pipeline_json).read_text(), f"file {args.pipeline_json}"
    else:
        import contextlib
        import io

        from rlstream.common.config import load_config
        from rlstream.harness.experiments import run_experiment

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):  # its tables and JSON; ours is the one JSON on stdout
            run_experiment("async", load_config(args.config), seconds=args.pipeline_seconds, reps=1)
        sys.stderr.write(buf.getvalue())
        text, source = buf.getvalue(), f"rlstream experiment async -c {args.config}, 1 rep"
    experiment = json.loads(text.strip().splitlines()[-1])
    return {"source": source, "arm_seconds": experiment.get("arm_seconds"), "reps": experiment.get("reps"),
            "consumer_wait_share": pipeline_wait_shares(experiment),
            "phases": {a: m.get("phases") for a, m in (experiment.get("arms") or {}).items()}}


def teardown(b: Bench) -> None:
    if b.stop is not None:
        b.stop.set()
    if b.prod is not None:
        b.prod.join(15)
        if b.prod.is_alive():
            b.prod.kill()
            b.prod.join()
    if b.svc is not None:
        b.svc.close()
    if b.broker is not None:
        b.broker.stop()
    shutil.rmtree(b.tmp, ignore_errors=True)


def main() -> None:
    args = _args()
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed by libraries goes to stderr; the JSON goes to out_fd
    _setup(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    b = Bench(Path(tempfile.mkdtemp(prefix="rlstream-bench-consumer-")))
    try:
        setup(args, b)
        warm(args, b)
        measured = measure(args, b)
        result = report(args, b, measured, t_start, load0)
    finally:
        teardown(b)
    result["feed"] = "synthetic: the topic kept full by a separate process (the trainer's own waiting)"
    pipeline = real_pipeline(args)
    result["consumer_wait_share_pipeline"] = pipeline and pipeline["consumer_wait_share"]
    result["pipeline"] = pipeline
    result["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    os.write(out_fd, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
