"""Producer benchmark (issue #3): publishing overhead and weight-reload cost. Prints one JSON object.

    .venv/bin/python tests/bench/producer.py [--reps 10] [--short-reps 6] [--threads 1] [--no-large] [--smoke]

`--smoke`: one round of 4 groups of 8-token responses, one reload, no larger model
(one engine start: ~1 min on 2 cores).

Starts its own broker (tansu, free port) and vLLM CPU engine on the tiny
model. One engine, one prompt list, three conditions run back to back in a
rotating order, `--reps` times (the machine is shared and noisy: ratios are
taken per repetition, between rounds seconds apart, then the median):

  without   the engine loop alone: submit groups (keeping `--max-groups` in
            flight, as the service's admission does), step, collect samples.
  encode    + `Trajectory.to_rollout` and `rlstream.common.record.encode` of every
            finished sample on the engine thread (no Kafka).
  with      + exactly the service's per-sample path: `to_rollout` and
            `Outbox.flush` (encode + `try_publish` on the engine thread; the
            publisher's dispatch thread and kafka-python's sender thread do the
            network work), then a drain: every record acknowledged by the
            broker before the round's clock stops.
All rounds generate the same tokens (ignore_eos, fixed response lengths).
Scoring (decode + verifier) is left out of every condition; it is not
publishing, and leaving it out makes the ratio conservative.

  publish_overhead      1 - tokens/s(with) / tokens/s(without), wall clock; target <= 0.05
  publish_cpu_overhead  the same with tokens per CPU-second (this process + the broker),
                        much less sensitive to other tenants than wall time
  encode_only_*         the same for "encode": the engine thread's own share
  cpu_us_per_record     where the extra CPU goes: the engine thread's publish calls,
                        the engine thread in total, the publisher threads, the broker
  short_responses       the same with 8-token responses (the tiny-cpu demo's max_tokens):
                        4.6x more records per token
  submission            the engine loop alone, each group one vLLM request of n (fan-out, the
                        engine's way) against n requests of one, alternated in one process;
                        `fanout_over_n_requests`: median samples/s ratio (`--submit-reps`)
  reload_seconds        tiny model: `engine.reload_weights` of a version written by
                        `WeightStore.write` (median); `verify_seconds`: `rlstream.common.weights.store.verify`
                        (size + sha256) of the same version, timed apart
  large.*               the same for a ~215 MB Qwen3-MoE (TinyModelSpec: hidden 512,
                        4 layers, 32 experts, head_dim 64) served by a second engine in a
                        child process (built and started while ours starts, idle while
                        we measure throughput)

stdout carries only the JSON; logs (ours and vLLM's) go to stderr.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

log = logging.getLogger("bench.producer")

# Shape of the larger synthetic model: 53.6 M parameters, ~215 MB in fp32.
LARGE_SPEC = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                  num_experts_per_tok=4)
SMOKE = dict(reps=1, groups_per_round=4, max_groups=2, lengths="8", short_reps=1, reload_repeats=1, no_large=True,
             submit_reps=1, submit_groups=8, submit_in_flight=4)


def _stdout_to_stderr() -> int:
    """Send fd 1 to stderr (vLLM logs to stdout); return a fd for the final JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    return saved


def _emit(fd: int, obj: dict) -> None:
    os.write(fd, (json.dumps(obj) + "\n").encode())


def _setup(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(threads)


def _med(xs) -> float:
    return float(statistics.median(xs))


def _engine(model_dir: Path, kv_bytes: int = 128 << 20, max_model_len: int = 128):
    """configs/tiny-cpu.yaml's engine: 256 sequences at once (32 groups of 8)."""
    from rlstream.common.config import EngineSettings
    from rlstream.producer.engine import RolloutEngine

    return RolloutEngine(EngineSettings(dtype="float32", max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes,
                                        max_num_seqs=256, seed=0), model_dir, version=0)


# ---------------------------------------------------------------------------
# reload: WeightStore.write -> verify -> engine.reload_weights
# ---------------------------------------------------------------------------
def measure_reloads(engine, model_dir: Path, store_root: Path, repeats: int) -> dict:
    """Write `repeats` versions (slightly scaled weights), then verify and reload each."""
    from safetensors.torch import load_file

    from rlstream.common.weights.store import WeightStore, verify

    base = load_file(str(model_dir / "model.safetensors"))
    store = WeightStore(store_root, keep=2)
    write_s, verify_s, reload_s, nbytes = [], [], [], 0
    for i in range(repeats):
        v = engine.version + 1
        scale = 1.0 + 1e-3 * (i + 1)
        tensors = {k: t * scale if t.is_floating_point() else t for k, t in base.items()}
        t0 = time.perf_counter()
        m = store.write(v, tensors, model_dir)
        write_s.append(time.perf_counter() - t0)
        del tensors
        t0 = time.perf_counter()
        path = verify(m["uri"], m["sha256"], m["bytes"])
        verify_s.append(time.perf_counter() - t0)
        reload_s.append(engine.reload_weights(path, v))
        nbytes = m["bytes"]
    # the reloaded engine still generates
    from rlstream.producer.sample import SamplingConfig

    engine.submit_group([5, 6, 7, 8], n=2, sampling=SamplingConfig(max_tokens=4, ignore_eos=True), tag="reload-check")
    out = []
    while engine.has_work():
        out += engine.step()
    assert len(out) == 2 and all(s.dispatch_version == engine.version for s in out), out
    return {"model_bytes": nbytes, "reload_seconds": round(_med(reload_s), 4),
            "verify_seconds": round(_med(verify_s), 4), "store_write_seconds": round(_med(write_s), 4),
            "reload_seconds_all": [round(x, 4) for x in reload_s],
            "reload_mb_per_s": round(nbytes / 1e6 / _med(reload_s), 1),
            "verify_mb_per_s": round(nbytes / 1e6 / _med(verify_s), 1), "repeats": repeats}


def large_child(args) -> None:
    """Child process: build the larger model, start its engine, wait for "go", measure reloads."""
    out_fd = _stdout_to_stderr()
    _setup(args.threads)
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model

    tmp = Path(args.work_dir)
    t0 = time.perf_counter()
    model_dir = build_tiny_model(tmp / "large-model", TinyModelSpec(**LARGE_SPEC))
    build_s = time.perf_counter() - t0
    n_bytes = (model_dir / "model.safetensors").stat().st_size
    log.info("large model built in %.1f s (%.0f MB); starting its engine", build_s, n_bytes / 1e6)
    engine = _engine(model_dir)
    start_s = engine.stats.start_seconds
    print("READY", file=sys.stderr, flush=True)
    sys.stdin.readline()  # parent: throughput rounds are done, the machine is ours
    try:
        res = measure_reloads(engine, model_dir, tmp / "large-weights", args.reload_repeats)
    finally:
        engine.close()
    res.update({"spec": LARGE_SPEC, "engine_start_seconds": round(start_s, 1),
                "model_build_seconds": round(build_s, 1)})
    _emit(out_fd, res)


# ---------------------------------------------------------------------------
# throughput: the same rounds with and without publishing
# ---------------------------------------------------------------------------
def make_workload(n_groups: int, lengths: list[int], seed: int) -> list[tuple[list[int], int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 64, int(rng.integers(8, 17))).tolist(), lengths[i % len(lengths)])
            for i in range(n_groups)]


CONDITIONS = ("without", "encode", "with")


def run_round(engine, workload, G: int, max_groups: int, tag: str, svc, mode: str) -> dict:
    """Generate every group of `workload`, keeping `max_groups` groups in flight.

    mode "with": every finished sample goes through the service's own
    record builder (`Trajectory.to_rollout`) and `Outbox.flush` (`svc` is a ProducerService that was not
    started, given our engine and outbox), then the round drains and waits
    for every acknowledgement. "encode": `to_rollout` + `rlstream.common.record.encode`
    only (the engine thread's share of the work, no Kafka). "without": nothing.
    """
    from rlstream.common.record import encode
    from rlstream.producer.rollout.trajectory import Trajectory
    from rlstream.producer.sample import SamplingConfig

    def to_record(s):
        return Trajectory.of_sample(s).to_rollout(svc.producer_id, svc.sampling, prompt_text="")

    todo = list(enumerate(workload))
    left: dict[str, int] = {}
    tokens0, pub_s, n_samples = engine.stats.generated_tokens, 0.0, 0
    broker0, eng0 = _pid_cpu_seconds(BROKER_PID), time.thread_time()
    cpu0 = time.process_time() + broker0
    t0 = time.perf_counter()
    while todo or engine.has_work():
        while todo and len(left) < max_groups:
            i, (prompt, max_tokens) = todo.pop(0)
            gid = f"{tag}-{i}"
            engine.submit_group(prompt, n=G, tag=gid,
                                sampling=SamplingConfig(max_tokens=max_tokens, ignore_eos=True))
            left[gid] = G
        finished = engine.step()
        for s in finished:
            left[s.tag] -= 1
            if not left[s.tag]:
                del left[s.tag]
        n_samples += len(finished)
        if mode == "with" and finished:
            tp = time.perf_counter()
            for s in finished:
                svc.outbox.add(to_record(s))
            svc.outbox.flush()
            pub_s += time.perf_counter() - tp
        elif mode == "encode" and finished:
            tp = time.perf_counter()
            for s in finished:
                encode(to_record(s))
            pub_s += time.perf_counter() - tp
    if mode == "with":  # the drain: what the buffer still holds, then every acknowledgement
        tp = time.perf_counter()
        svc.outbox.drain(timeout_s=60)
        pub_s += time.perf_counter() - tp
    wall = time.perf_counter() - t0
    broker_cpu = _pid_cpu_seconds(BROKER_PID) - broker0
    cpu = time.process_time() + broker_cpu + broker0 - cpu0
    tokens = engine.stats.generated_tokens - tokens0
    return {"tokens": tokens, "samples": n_samples, "wall": wall, "tps": tokens / wall, "publish_call_s": pub_s,
            "cpu": cpu, "tpcpu": tokens / cpu, "broker_cpu": broker_cpu, "engine_cpu": time.thread_time() - eng0}


def service_stand_in(kafka, args, engine, publisher, max_tokens: int):
    """A real ProducerService (its per-sample code), not started: our engine and publisher plugged in
    (the outbox's acknowledgement callback feeds a real TopicEnds, as in the service)."""
    from rlstream.common.config import RlstreamConfig
    from rlstream.producer.service import ProducerService

    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"build_tiny": False},
        "producer": {"group_size": args.group_size, "max_tokens": max_tokens, "producer_id": "bench",
                     "max_groups_in_flight": args.max_groups, "num_threads": args.threads},
        "consumer": {"group_size": args.group_size}})
    svc = ProducerService(cfg, kafka.bootstrap_servers)
    from rlstream.producer.admission import TopicEnds
    from rlstream.producer.outbox import Outbox

    svc.engine, svc.publisher, svc.topic_ends = engine, publisher, TopicEnds(kafka)
    svc.outbox = Outbox(publisher, on_delivered=svc.topic_ends.on_delivered)
    return svc


BROKER_PID: int | None = None


def _schedstat_seconds(task_dir: str) -> float:
    """On-CPU seconds of one task (thread) from /proc/.../schedstat (ns resolution)."""
    try:
        return int(Path(task_dir, "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _pid_cpu_seconds(pid: int | None) -> float:
    """On-CPU seconds used so far by all threads of process `pid` (0.0 if unknown)."""
    if pid is None:
        return 0.0
    return sum(_schedstat_seconds(str(t)) for t in Path(f"/proc/{pid}/task").glob("*"))


def _thread_cpu_seconds(prefixes: tuple[str, ...]) -> float:
    """On-CPU seconds used so far by this process's threads whose name starts with a prefix."""
    import threading

    return sum(_schedstat_seconds(f"/proc/self/task/{t.native_id}") for t in threading.enumerate()
               if t.native_id is not None and t.name.startswith(prefixes))


# the publisher's dispatch thread and kafka-python's sender thread
_PUBLISHER_THREADS = ("rlstream-publisher", "kafka-python")


def measure_throughput(engine, svc, kafka, lengths: list[int], n_groups: int, reps: int, args, name: str) -> dict:
    from rlstream.common import metrics

    G = args.group_size
    workload = make_workload(n_groups, lengths, seed=1)
    published0 = metrics.value("rlstream_published_records_total", topic=kafka.topics.rollouts)
    for c in CONDITIONS:  # warm-up: allocator, kafka-python connections, metadata
        run_round(engine, workload[:4], G, args.max_groups, f"{name}-warm-{c}", svc, c)
    rounds = {c: [] for c in CONDITIONS}
    for p in range(reps):
        k = p % len(CONDITIONS)  # rotate the order, so no condition always runs first or last
        for c in CONDITIONS[k:] + CONDITIONS[:k]:
            cpu0 = _thread_cpu_seconds(_PUBLISHER_THREADS)
            r = run_round(engine, workload, G, args.max_groups, f"{name}{p}-{c}", svc, c)
            r["bg_cpu_s"] = _thread_cpu_seconds(_PUBLISHER_THREADS) - cpu0
            rounds[c].append(r)
            log.info("%s rep %d %-7s %6d tokens %5.2f s %7.0f tok/s %7.0f tok/cpu-s; publish calls %.3f s, "
                     "publisher threads %.2f cpu-s", name, p, c, r["tokens"], r["wall"], r["tps"], r["tpcpu"],
                     r["publish_call_s"], r["bg_cpu_s"])
    published = metrics.value("rlstream_published_records_total", topic=kafka.topics.rollouts) - published0
    expected = sum(r["samples"] for r in rounds["with"]) + 4 * G
    if published != expected:
        log.error("broker acknowledged %d records, expected %d", published, expected)
    w, e, wo = rounds["with"], rounds["encode"], rounds["without"]
    assert len({r["tokens"] for rs in rounds.values() for r in rs}) == 1, "conditions did unequal work"

    def overhead(xs, key):  # per repetition: the two rounds ran within seconds of each other
        return [1 - a[key] / b[key] for a, b in zip(xs, wo)]

    samples = w[0]["samples"]
    return {
        "publish_overhead": round(_med(overhead(w, "tps")), 4),
        "publish_overhead_reps": [round(x, 4) for x in overhead(w, "tps")],
        "publish_cpu_overhead": round(_med(overhead(w, "tpcpu")), 4),
        "encode_only_overhead": round(_med(overhead(e, "tps")), 4),
        "encode_only_cpu_overhead": round(_med(overhead(e, "tpcpu")), 4),
        "tokens_per_second_with_publish": round(_med([r["tps"] for r in w]), 1),
        "tokens_per_second_without_publish": round(_med([r["tps"] for r in wo]), 1),
        "records_per_second": round(_med([r["samples"] / r["wall"] for r in w]), 1),
        "engine_thread_publish_share": round(_med([r["publish_call_s"] / r["wall"] for r in w]), 4),
        # where the extra CPU goes, per record (medians of the "with" rounds minus "without")
        "cpu_us_per_record": {
            "engine_thread_publish_calls": round(1e6 * _med([r["publish_call_s"] for r in w]) / samples, 1),
            "engine_thread_total_extra": round(1e6 * (_med([r["engine_cpu"] for r in w])
                                                      - _med([r["engine_cpu"] for r in wo])) / samples, 1),
            "publisher_threads": round(1e6 * _med([r["bg_cpu_s"] for r in w]) / samples, 1),
            "broker": round(1e6 * (_med([r["broker_cpu"] for r in w])
                                   - _med([r["broker_cpu"] for r in wo])) / samples, 1),
            "all_extra": round(1e6 * (_med([r["cpu"] for r in w]) - _med([r["cpu"] for r in wo])) / samples, 1)},
        "records_acknowledged": int(published), "records_expected": int(expected),
        "workload": {"groups_per_round": n_groups, "group_size": G, "response_lengths": lengths,
                     "max_groups_in_flight": args.max_groups, "tokens_per_round": w[0]["tokens"],
                     "records_per_round": samples, "repetitions": reps},
    }


# ---------------------------------------------------------------------------
# main: setup -> measure -> large-model child -> report
# ---------------------------------------------------------------------------
@dataclass
class Bench:
    """What setup builds (each field set as soon as it exists, so teardown closes it)."""

    tmp: Path
    child: subprocess.Popen | None = None
    broker: object = None
    kafka: object = None
    model_dir: Path | None = None
    engine: object = None
    publisher: object = None
    svc: object = None


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10, help="repetitions of the three conditions")
    ap.add_argument("--groups-per-round", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-groups", type=int, default=8, help="groups in flight (producer.max_groups_in_flight)")
    ap.add_argument("--lengths", default="16,32,64", help="response lengths, cycled over groups")
    ap.add_argument("--short-reps", type=int, default=6,
                    help="repetitions of the short-response workload (8 tokens: the tiny-cpu demo); 0 skips it")
    ap.add_argument("--submit-reps", type=int, default=6,
                    help="repetitions of the group-submission A/B (fan-out vs n requests); 0 skips it")
    ap.add_argument("--submit-groups", type=int, default=320, help="groups per round of that A/B")
    ap.add_argument("--submit-in-flight", type=int, default=32, help="groups in flight in that A/B")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (producer.num_threads)")
    ap.add_argument("--reload-repeats", type=int, default=5)
    ap.add_argument("--no-large", action="store_true", help="skip the larger-model reload")
    ap.add_argument("--large-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    return parse_args(ap, SMOKE)


def setup(args, b: Bench) -> None:
    """The large-model child (it builds and starts its engine while ours starts), broker,
    topics, tiny model, our engine and publisher, and the service stand-in."""
    global BROKER_PID
    from rlstream.common.config import BrokerSettings
    from rlstream.common.kafka.broker import EmbeddedBroker
    from rlstream.common.kafka.publisher import RolloutPublisher
    from rlstream.toy.tinymodel import build_tiny_model
    from tests.fixtures.kafka import make_kafka_settings

    if not args.no_large:
        b.child = subprocess.Popen([sys.executable, __file__, "--large-child", "--work-dir", str(b.tmp),
                                    "--threads", str(args.threads), "--reload-repeats", "3"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    b.broker = EmbeddedBroker(BrokerSettings(port=0)).start()
    BROKER_PID = b.broker.pid  # its CPU counts as publishing cost
    b.kafka = make_kafka_settings(b.broker.bootstrap, b.tmp / "blobs", rollouts_partitions=2)
    b.model_dir = build_tiny_model(b.tmp / "tiny")
    b.engine = _engine(b.model_dir)
    b.publisher = RolloutPublisher(b.kafka)
    b.svc = service_stand_in(b.kafka, args, b.engine, b.publisher, 64)


def measure_submission(engine, args) -> dict:
    """The engine loop alone (`run_round` "without") with each group as one vLLM request
    of n samples (fan-out, the engine's way) and as n requests of one (the path before),
    alternated in one process: `--submit-in-flight` groups of G in flight, 8-token
    responses (the tiny-cpu demo's)."""
    workload = make_workload(args.submit_groups, [8], seed=1)
    rounds = itertools.count()

    def samples_per_s(fan_out: bool) -> float:
        engine.fan_out_groups = fan_out
        r = run_round(engine, workload, args.group_size, args.submit_in_flight, f"sub{next(rounds)}", None, "without")
        return r["samples"] / r["wall"]

    try:
        samples_per_s(True), samples_per_s(False)  # warm both paths
        each = {"fanout": [], "n_requests": []}
        for rep in range(args.submit_reps):  # the order alternates, per repetition
            for mode in (("fanout", "n_requests") if rep % 2 == 0 else ("n_requests", "fanout")):
                each[mode].append(round(samples_per_s(mode == "fanout"), 1))
    finally:
        engine.fan_out_groups = True
    ratios = [a / b for a, b in zip(each["fanout"], each["n_requests"])]
    return {"samples_per_s": each, "ratio_each": [round(x, 3) for x in ratios],
            "fanout_over_n_requests": round(statistics.median(ratios), 3) if ratios else None,
            "groups_per_round": args.submit_groups, "in_flight": args.submit_in_flight, "group_size": args.group_size}


def measure(args, b: Bench) -> dict:
    """Throughput (main and short workloads) and tiny-model reloads; then our engine closes
    (the large-model child measures next, alone)."""
    thr = measure_throughput(b.engine, b.svc, b.kafka, [int(x) for x in args.lengths.split(",")],
                             args.groups_per_round, args.reps, args, "main")
    short = None
    if args.short_reps:
        short = measure_throughput(b.engine, b.svc, b.kafka, [8], 2 * args.groups_per_round, args.short_reps,
                                   args, "short")
    submission = measure_submission(b.engine, args) if args.submit_reps else None
    tiny = measure_reloads(b.engine, b.model_dir, b.tmp / "weights", args.reload_repeats)
    engine_start = b.engine.stats.start_seconds
    b.publisher.close()
    b.publisher = None
    b.engine.close()
    b.engine = None
    return {"throughput": thr, "short": short, "submission": submission, "tiny": tiny,
            "engine_start": engine_start}


def large_result(child: subprocess.Popen | None) -> dict | None:
    """The large-model child's JSON (None without a child, or if it failed)."""
    if child is None:
        return None
    out, _ = child.communicate("go\n", timeout=300)
    large = json.loads(out.strip().splitlines()[-1]) if child.returncode == 0 and out.strip() else None
    if large is None:
        log.error("large-model child failed (exit %s)", child.returncode)
    return large


def report(args, m: dict, large: dict | None, t_start: float, load0: float) -> dict:
    return {
        "bench": "producer", "date": time.strftime("%Y-%m-%d"),
        "model": "tiny-qwen3-moe (2 layers, 8 experts, top-2), fp32, CPU routing capture",
        **m["throughput"],
        "short_responses": m["short"],
        "submission": m["submission"],
        "reload_seconds": m["tiny"]["reload_seconds"], "verify_seconds": m["tiny"]["verify_seconds"],
        "tiny": m["tiny"], "engine_start_seconds": round(m["engine_start"], 1),
        "large": large,
        "threads": args.threads, "smoke": args.smoke, "bench_seconds": round(time.perf_counter() - t_start, 1),
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],  # start, end: 2 cores, shared
    }


def teardown(b: Bench) -> None:
    if b.child is not None and b.child.poll() is None:
        b.child.kill()
        b.child.wait()
    if b.publisher is not None:
        b.publisher.close(timeout=5)
    if b.engine is not None:
        b.engine.close()
    if b.broker is not None:
        b.broker.stop()
    shutil.rmtree(b.tmp, ignore_errors=True)


def main() -> None:
    args = _args()
    if args.large_child:
        return large_child(args)
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    out_fd = _stdout_to_stderr()
    _setup(args.threads)
    b = Bench(Path(tempfile.mkdtemp(prefix="rlstream-bench-producer-")))
    try:
        setup(args, b)
        measured = measure(args, b)
        _emit(out_fd, report(args, measured, large_result(b.child), t_start, load0))
    finally:
        teardown(b)


if __name__ == "__main__":
    main()
