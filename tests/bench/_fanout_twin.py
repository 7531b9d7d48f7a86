"""Weight delivery to P producers on the cluster twin (issue 23, N4): chain fan-out vs star.

    out = measure_fanout(producers=[1, 2, 4], rate_mbit=300, model_mb=32, reps=3)

Hosts are network namespaces with tbf-shaped NICs (common/cluster/twin.py): one trainer
host, one host per producer, so the NIC (not the machine's two CPUs) is the bottleneck and
`twin.nic_bytes` counts what leaves the trainer's host. The trainer is a child process running
the real WeightSender (links, fan-out group, Snapshot); each producer is a child process
running the real receiving engine (producer/weights/gloo_engine.py RlstreamGlooEngine: chain
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("bench.fanout")
TIMEOUT_S = 60.0
GROUPS = 8


def _tensors(version: int, model_mb: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(version)
    n = model_mb * (1 << 20) // 4 // GROUPS
    return {f"model.layers.{i}.w": torch.randn(n, generator=g) for i in range(GROUPS)}


def _say(obj: dict) -> None:
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


# ====================================================================== the trainer child


def trainer_main(host: str, model_mb: int) -> None:
    from common.config import WeightSyncSettings
    from consumer.weights.engines import Snapshot
    from consumer.weights.sender import WeightSender
    from tests.support.weights import corrupting, dict_source

    sender, version, snap = None, 0, None
    versions = [_tensors(1, model_mb), _tensors(2, model_mb)]

    def publish(corrupt: bool = False) -> float:
        nonlocal version, snap
        version += 1
        t0 = time.perf_counter()
        snap = Snapshot(version, dict_source(versions[version % 2]), reuse=snap)
        with corrupting(corrupt, thread="rlstream-weights-fanout"):
            sender.publish(snap)
            snap.fill()
            sender.wait_delivered(version, TIMEOUT_S * 3)
        return time.perf_counter() - t0

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "sender":
            if sender is not None:
                sender.close()
            sender = WeightSender(WeightSyncSettings(host=host, timeout_s=TIMEOUT_S), topology=cmd["topology"])
            _say({"endpoint": sender.endpoint})
        elif cmd["op"] == "warm":  # every producer registered, then a version over their own links
            deadline = time.monotonic() + TIMEOUT_S * 3
            while len(sender.links) < cmd["producers"] and time.monotonic() < deadline:
                time.sleep(0.05)
            publish()
            publish()  # chain: the group forms on this one
            _say({"links": len(sender.links), "failures": sender.failures})
        elif cmd["op"] == "round":
            secs = [publish() for _ in range(cmd["reps"])]
            _say({"seconds": secs, "failures": sender.failures, "links": len(sender.links)})
        elif cmd["op"] == "tamper":
            publish(corrupt=True)
            # every producer refused the group's copy, was dropped and re-registered: wait until
            # all are back and hold the version (links is empty for a moment in between)
            deadline = time.monotonic() + TIMEOUT_S * 2
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

        from producer.weights.gloo_engine import RlstreamGlooEngine, RlstreamGlooUpdateInfo

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


def producer_main(name: str) -> None:
    """Poll the link as the reloader does: serve each verified version (discard its staging:
    no model here), re-register a broken link, count refusals."""
    from producer.weights.trainer_link import TrainerLink

    engine = InProcessEngine()
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
                link = TrainerLink.connect(engine, endpoint, name, TIMEOUT_S)
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
        st = engine.weight_status()
        if st["state"] == "ready" and st["version"] > served:
            served = st["version"]
            link.swapped = (st["version"], st["digest"])
            engine.discard_weights()
        elif st["state"] == "failed":
            engine.discard_weights()
            if st["digest_mismatch"]:
                refused.append(st["error"][:200])
            else:
                link.dead = link.dead or st["error"]
        if link.dead:
            link = TrainerLink.connect(engine, endpoint, name, TIMEOUT_S)


# ====================================================================== the bench side


class Child:
    def __init__(self, twin, host: str, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
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
                   topologies=("chain", "star")) -> dict:
    from common.cluster.twin import ClusterTwin, Host, unavailable_reason

    why = unavailable_reason()
    if why:
        return {"skipped": f"no cluster twin here: {why}"}
    hosts = [Host("trainer", rate_mbit=rate_mbit)] + [Host(f"p{i}", rate_mbit=rate_mbit) for i in range(max(producers))]
    model_bytes = model_mb * (1 << 20)
    out: dict = {"rate_mbit": rate_mbit, "model_bytes": model_bytes, "reps": reps, "groups": GROUPS}
    with ClusterTwin(hosts) as twin:
        trainer = Child(twin, "trainer", ["--trainer", twin.address("trainer"), str(model_mb)])
        prods = [Child(twin, f"p{i}", ["--producer", f"p{i}"]) for i in range(max(producers))]
        for topology in topologies:
            rows = out[topology] = {}
            for n in producers:
                endpoint = trainer.ask(op="sender", topology=topology)["endpoint"]
                for p in prods[:n]:
                    p.tell(op="connect", endpoint=endpoint)
                warm = trainer.ask(op="warm", producers=n)
                before = [p.ask(op="report") for p in prods[:n]]
                tx0 = twin.nic_bytes("trainer")[1]
                r = trainer.ask(op="round", reps=reps)
                tx = twin.nic_bytes("trainer")[1] - tx0
                after = [p.ask(op="report") for p in prods[:n]]
                stall = [(a["poll_s"] - b["poll_s"]) / reps for a, b in zip(after, before)]
                rows[f"p{n}"] = {"delivery_seconds": round(statistics.median(r["seconds"]), 3),
                                 "all_seconds": [round(s, 3) for s in r["seconds"]],
                                 "egress_over_model": round(tx / reps / model_bytes, 3),
                                 "stall_seconds": round(statistics.median(stall), 4),
                                 "stall_max_seconds": round(max(a["poll_max_s"] for a in after), 4),
                                 "failures": r["failures"], "warm": warm}
                log.info("fan-out %s P=%d: %s", topology, n, rows[f"p{n}"])
                if topology == topologies[0] and n == max(producers):
                    before = [p.ask(op="report") for p in prods[:n]]
                    v = trainer.ask(op="tamper", producers=n)["version"]
                    after = [p.ask(op="report") for p in prods[:n]]
                    # every producer refused the flipped copy (it kept its version meanwhile) and
                    # then took the version, intact, over its own link
                    out["tamper_refused"] = all(len(a["refused"]) > len(b["refused"]) and a["served"] == v
                                                for a, b in zip(after, before))
                for p in prods[:n]:
                    p.tell(op="disconnect")
        trainer.tell(op="exit")
        for p in prods:
            p.tell(op="exit")
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
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.stdout = sys.stderr  # our JSON lines go to the real stdout only (_say)
    import torch

    torch.set_num_threads(1)
    if sys.argv[1] == "--trainer":
        trainer_main(sys.argv[2], int(sys.argv[3]))
    else:
        producer_main(sys.argv[2])
