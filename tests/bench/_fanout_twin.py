"""Weight delivery to P producers on the cluster twin (issue 23, N4): chain fan-out vs star.

    out = measure_fanout(producers=[1, 2, 4], rate_mbit=300, model_mb=32, reps=3)

Hosts are network namespaces with tbf-shaped NICs (ops/cluster/twin.py): one trainer
host, one host per producer, so the NIC (not the machine's two CPUs) is the bottleneck and
`twin.nic_bytes` counts what leaves the trainer's host. The trainer is a child process running
the real WeightSender (links, fan-out group, Snapshot); each producer is a child process
running the real receiving engine (producer/weights/worker/gloo_engine.py RlstreamGlooEngine: chain
relay, digests, staging) behind the real TrainerLink, polled as the reloader polls it. No
vLLM engine generates here: the 2 cores cannot hold four (tests/bench/weights.py measures
real producers on loopback).

Per topology (`chain`: the fan-out group; `star`: one link per producer, what main did) and P:
  delivery_seconds   publish -> the trainer holds every producer's verified ack (median)
  egress_over_model  bytes out of the trainer host's NIC per version / the version's bytes
  stall_seconds      per producer and version: time its loop spent inside link.poll
                     (commands; receiving runs in the background). This loop polls every
                     5 ms and each poll is a store round trip over the producer's NIC, which
                     the version saturates (tbf queue): a real producer polls once per
                     engine step, so this sums more round trips than it would
  stall_max_seconds  the longest single poll in the window: one engine step's worst stall
Then `tamper_refused`: a version with one byte flipped on the chain, after its digest was
taken: every producer refuses it (keeping the version it had), and gets it intact over its own
link once the trainer drops the group's failed round.

Helper of tests/bench/weights.py (the leading underscore: not a bench of its own). Children
speak JSON lines on stdin/stdout; their logs go to stderr.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("bench.fanout")
TIMEOUT_S = 60.0
BACKENDS = {"gloo": "rlstream_gloo", "nccl-standin": "nccl"}
"""The bench's transports: the gloo chain, or vLLM's own NCCL engines over the GPU stand-ins."""
GROUPS = 8


def _say(obj: dict) -> None:
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


# ====================================================================== the trainer child


def trainer_main(host: str, model_mb: int, transport: str, timeout_s: float) -> None:
    from rlstream.common.config import WeightSyncSettings
    from rlstream.consumer.weights.snapshot import Snapshot
    from rlstream.consumer.weights.sender import WeightSender
    from tests.support.weights import corrupting, dict_source, random_version

    sender, version, snap, pending = None, 0, None, None
    versions = [random_version(v, GROUPS, model_mb * (1 << 20) // GROUPS) for v in (1, 2)]

    def publish(corrupt: bool = False) -> float:
        nonlocal version, snap
        version += 1
        t0 = time.perf_counter()
        snap = Snapshot(version, dict_source(versions[version % 2]), reuse=snap)
        with corrupting(corrupt, thread="rlstream-weights-fanout", transport=transport):
            sender.publish(snap)
            snap.fill()
            sender.wait_delivered(version, timeout_s * 3)
        return time.perf_counter() - t0

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "sender":
            if sender is not None:
                sender.close()
            sender = WeightSender(WeightSyncSettings(host=host, timeout_s=timeout_s), topology=cmd["topology"],
                                  backend=BACKENDS[transport])
            _say({"endpoint": sender.endpoint})
        elif cmd["op"] == "warm":  # every producer registered, then a version over their own links
            deadline = time.monotonic() + timeout_s * 3
            while len(sender.links) < cmd["producers"] and time.monotonic() < deadline:
                time.sleep(0.05)
            publish()
            publish()  # chain: the group forms on this one
            _say({"links": len(sender.links), "failures": sender.failures})
        elif cmd["op"] == "round":
            secs = [publish() for _ in range(cmd["reps"])]
            _say({"seconds": secs, "failures": sender.failures, "links": len(sender.links)})
        elif cmd["op"] == "start":  # a version the bench kills a producer in the middle of
            coming = version + 1
            pending = ThreadPoolExecutor(1).submit(publish)
            _say({"version": coming})
        elif cmd["op"] == "finish":
            _say({"seconds": pending.result(), "failures": sender.failures, "links": len(sender.links)})
        elif cmd["op"] == "tamper":
            publish(corrupt=True)
            # every producer refused the group's copy, was dropped and re-registered: wait until
            # all are back and hold the version (links is empty for a moment in between)
            deadline = time.monotonic() + timeout_s * 2
            while time.monotonic() < deadline and not (len(sender.links) >= cmd["producers"]
                                                       and sender.wait_delivered(version, 0.1)):
                time.sleep(0.05)
            _say({"version": version, "failures": sender.failures})
        elif cmd["op"] == "exit":
            break
    if sender is not None:
        sender.close()


# ====================================================================== a producer child


class InProcessEngine:
    """The producer engine as TrainerLink sees it, one worker, in this process: the real
    RlstreamGlooEngine on a stub vLLM config (as tests/support/weights.py WorkerProcesses)."""

    weight_transfer = "rlstream_gloo"
    weight_workers = 1

    def __init__(self):
        from types import SimpleNamespace

        import torch

        from rlstream.producer.weights.worker.gloo_engine import RlstreamGlooEngine, RlstreamGlooUpdateInfo

        parallel = SimpleNamespace(world_size=1, rank=0, data_parallel_index=0)
        self.engine = RlstreamGlooEngine(None, SimpleNamespace(parallel_config=parallel, model_config=None), "cpu",
                                         torch.nn.Module())
        self._info = RlstreamGlooUpdateInfo

    def init_weight_link(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def receive_weights(self) -> None:
        self.engine.receive_weights(self._info(op="receive"))

    def weight_status(self) -> dict:
        return self.engine.status()

    def discard_weights(self) -> None:
        self.engine.receive_weights(self._info(op="discard"))


class InProcessNcclEngine:
    """The producer engine with vLLM's NCCLWeightTransferEngine (one worker, in this process, over
    the GPU stand-ins), driven as producer.engine.RolloutEngine drives it: the update is rlstream's
    folded update under its watchdog, into a model that keeps nothing (as tests/support/weights.py)."""

    weight_transfer = "nccl"
    weight_workers = 1

    def __init__(self):
        from types import SimpleNamespace

        import torch
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        # what the receive imports, imported now as a vLLM worker has (it loaded a model at start):
        # on a loaded machine the first update's import outlasted the watchdogs' bound
        from vllm.model_executor.model_loader import mtp_validation  # noqa: F401

        class Model(torch.nn.Module):
            def load_weights(self, weights):
                for _ in weights:
                    pass
                return set()
        parallel = SimpleNamespace(world_size=1, rank=0, data_parallel_index=0)
        self.engine = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), SimpleNamespace(
            parallel_config=parallel, model_config=None), torch.device("cpu"), Model())
        self.weight_transfer_engine = self.engine

    def init_weight_link(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def close_weight_link(self) -> None:
        self.engine.shutdown()

    def load_weight_update(self, update_info: dict, timeout_s: float) -> str:
        from rlstream.producer.weights.worker.verified_update import update_weights_folded

        return update_weights_folded(self, update_info, timeout_s)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.engine.update_weights(update_info)

    def finish_weight_update(self) -> None:
        pass


def producer_main(name: str, transport: str, timeout_s: float) -> None:
    """Poll the link as the reloader does: serve each verified version (discard its staging:
    no model here), re-register a broken link, count refusals (a version refused on a live link)."""
    from rlstream.producer.weights.trainer_link import TrainerLink

    engine = InProcessNcclEngine() if transport == "nccl-standin" else InProcessEngine()
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [commands.put(json.loads(line)) for line in sys.stdin], daemon=True).start()
    link, endpoint = None, None
    served, refused, poll_s, poll_max = 0, [], 0.0, 0.0
    while True:
        try:
            cmd = commands.get(timeout=0.005)
        except queue.Empty:
            cmd = None
        if cmd is not None:
            if cmd["op"] == "connect":
                endpoint = cmd["endpoint"]
                link = TrainerLink.connect(engine, endpoint, name, timeout_s)
            elif cmd["op"] == "disconnect":
                link, endpoint = None, None
            elif cmd["op"] == "report":
                _say({"served": served, "refused": refused, "poll_s": poll_s, "poll_max_s": poll_max})
                poll_max = 0.0
            elif cmd["op"] == "exit":
                return
        if link is None:
            continue
        t0 = time.perf_counter()
        link.poll()
        poll_s += time.perf_counter() - t0
        poll_max = max(poll_max, time.perf_counter() - t0)
        if (u := link.take_update()) is not None:  # as Reloader._take_update
            why = u.error or (None if u.received == u.expected else f"digest {u.received} != sent {u.expected}")
            link.answer_update(u, why)
            if u.staged:
                engine.discard_weights()  # no model here: served or refused, the staging goes
            if why is None:
                served = u.version
            elif not link.dead:
                refused.append(why[:200])
        if link.dead:
            link = TrainerLink.connect(engine, endpoint, name, timeout_s)


# ====================================================================== the bench side


class Child:
    def __init__(self, twin, host: str, argv: list[str], transport: str = "gloo"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if transport == "nccl-standin":
            env["RLSTREAM_GPU_STANDIN"] = "1"  # libnccl, CUDA streams, pinned memory: common/gpu_standin/
        self.p = twin.popen(host, [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True, bufsize=1)

    def tell(self, **cmd) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def ask(self, **cmd) -> dict:
        self.tell(**cmd)
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"a bench child exited (rc {self.p.poll()}) answering {cmd}")
        return json.loads(line)


def measure_fanout(producers: list[int], rate_mbit: float, model_mb: int, reps: int,
                   topologies=("chain", "star"), transport: str = "gloo", timeout_s: float = TIMEOUT_S,
                   dead_member: bool = True) -> dict:
    from rlstream.cluster.twin import ClusterTwin, Host, unavailable_reason

    why = unavailable_reason()
    if why:
        return {"skipped": f"no cluster twin here: {why}"}
    hosts = [Host("trainer", rate_mbit=rate_mbit)] + [Host(f"p{i}", rate_mbit=rate_mbit) for i in range(max(producers))]
    model_bytes = model_mb * (1 << 20)
    out: dict = {"transport": transport, "rate_mbit": rate_mbit, "model_bytes": model_bytes, "reps": reps,
                 "groups": GROUPS, "timeout_s": timeout_s}
    with ClusterTwin(hosts) as twin:
        common = [transport, str(timeout_s)]
        trainer = Child(twin, "trainer", ["--trainer", twin.address("trainer"), str(model_mb), *common], transport)
        prods = [Child(twin, f"p{i}", ["--producer", f"p{i}", *common], transport) for i in range(max(producers))]
        for topology in topologies:
            rows = out[topology] = {}
            for n in producers:
                endpoint = trainer.ask(op="sender", topology=topology)["endpoint"]
                for p in prods[:n]:
                    p.tell(op="connect", endpoint=endpoint)
                rows[f"p{n}"] = _round(twin, trainer, prods[:n], reps, model_bytes)
                log.info("fan-out %s P=%d: %s", topology, n, rows[f"p{n}"])
                if topology == topologies[0] and n == max(producers):
                    out["tamper_refused"] = _tamper_refused(trainer, prods[:n])
                if dead_member and topology == topologies[0] and n == max(producers) and n > 1:
                    out["dead_member"] = _dead_member(twin, trainer, prods[:n], rows[f"p{n}"]["delivery_seconds"],
                                                      timeout_s)
                    prods = prods[:n - 1] + [Child(twin, f"p{n - 1}", ["--producer", f"p{n - 1}", *common],
                                                   transport)] + prods[n:]
                for p in prods[:n]:
                    p.tell(op="disconnect")
        trainer.tell(op="exit")
        for p in prods:
            p.tell(op="exit")
    _summarize(out, producers, topologies)
    return out


def _round(twin, trainer: Child, prods: list[Child], reps: int, model_bytes: int) -> dict:
    """`reps` versions to `prods` (connected): delivery time, the trainer's egress, the producers' stalls."""
    warm = trainer.ask(op="warm", producers=len(prods))
    before = [p.ask(op="report") for p in prods]
    tx0 = twin.nic_bytes("trainer")[1]
    r = trainer.ask(op="round", reps=reps)
    tx = twin.nic_bytes("trainer")[1] - tx0
    after = [p.ask(op="report") for p in prods]
    stall = [(a["poll_s"] - b["poll_s"]) / reps for a, b in zip(after, before)]
    return {"delivery_seconds": round(statistics.median(r["seconds"]), 3),
            "all_seconds": [round(s, 3) for s in r["seconds"]],
            "egress_over_model": round(tx / reps / model_bytes, 3),
            "stall_seconds": round(statistics.median(stall), 4),
            "stall_max_seconds": round(max(a["poll_max_s"] for a in after), 4),
            "failures": r["failures"], "warm": warm}


def _tamper_refused(trainer: Child, prods: list[Child]) -> bool:
    """A version with one byte flipped on the way: every producer refused the flipped copy (it kept
    its version meanwhile) and then took the version, intact, over its own link."""
    before = [p.ask(op="report") for p in prods]
    v = trainer.ask(op="tamper", producers=len(prods))["version"]
    after = [p.ask(op="report") for p in prods]
    return all(len(a["refused"]) > len(b["refused"]) and a["served"] == v for a, b in zip(after, before))


def _summarize(out: dict, producers: list[int], topologies) -> None:
    """The headline figures, from the first topology's rows (and the star's, if measured)."""
    lo, hi = min(producers), max(producers)
    chain = out[topologies[0]]
    out["delivery_p4_over_p1"] = round(chain[f"p{hi}"]["delivery_seconds"] / chain[f"p{lo}"]["delivery_seconds"], 3)
    out["trainer_egress_over_model_bytes"] = chain[f"p{hi}"]["egress_over_model"]
    out["producer_stall_seconds"] = chain[f"p{hi}"]["stall_seconds"]
    out["producer_stall_max_seconds"] = chain[f"p{hi}"]["stall_max_seconds"]
    if "star" in out:
        star = out["star"]
        out["star_delivery_p4_over_p1"] = round(star[f"p{hi}"]["delivery_seconds"] / star[f"p{lo}"]["delivery_seconds"], 3)
        out["star_trainer_egress_over_model_bytes"] = star[f"p{hi}"]["egress_over_model"]
    out["producers"] = producers
    out["dead_member_cost_s"] = out.get("dead_member", {}).get("cost_s")


def _dead_member(twin, trainer: Child, prods: list[Child], normal_s: float, timeout_s: float) -> dict:
    """A version during which the last producer is SIGKILLed, once every member is receiving
    it: how much longer the others take to hold it than a version without a death."""
    t0 = time.monotonic()
    v = trainer.ask(op="start")["version"]
    time.sleep(min(0.5, normal_s / 3))  # the group is in the version's transfer
    victim = prods[-1]
    os.killpg(victim.p.pid, 9)
    victim.p.wait(30)
    held = None
    while time.monotonic() - t0 < 4 * timeout_s + normal_s:
        if all(p.ask(op="report")["served"] >= v for p in prods[:-1]):
            held = time.monotonic() - t0
            break
        time.sleep(0.05)
    r = trainer.ask(op="finish")
    cost = None if held is None else round(held - normal_s, 3)
    return {"version": v, "others_held_after_s": None if held is None else round(held, 3),
            "normal_seconds": normal_s, "cost_s": cost,
            "cost_over_timeout": None if cost is None else round(cost / timeout_s, 3), "failures": r["failures"]}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.stdout = sys.stderr  # our JSON lines go to the real stdout only (_say)
    import torch

    torch.set_num_threads(1)
    transport, timeout_s = sys.argv[-2], float(sys.argv[-1])
    if transport == "nccl-standin":
        from rlstream.common import gpu_standin

        gpu_standin.install()
    if sys.argv[1] == "--trainer":
        trainer_main(sys.argv[2], int(sys.argv[3]), transport, timeout_s)
    else:
        producer_main(sys.argv[2], transport, timeout_s)
