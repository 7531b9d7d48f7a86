"""A shipped deployment on a cluster twin with shaped NICs: versions, seconds, bytes. One JSON object.

    .venv/bin/python tests/bench/cluster.py [--layout compose|systemd|k8s] [--trainers 2] [--producers 2]
        [--tp2] [--versions 8] [--rate-mbit 1000] [--smoke]

Hosts are network namespaces (ops/cluster/twin.py), every NIC shaped to
--rate-mbit each way with tc tbf; the services are ops/compose/docker-compose.yml,
the ops/systemd/ units (--trainers hosts) or the ops/k8s/ manifests (the JobSet's
trainer nodes) as shipped, with the CPU swaps of ops/harness/rehearsal/
(listed in the output's `swaps`). After the first version (engine warm-up, first
links), it trains --versions more and reports:

  versions_trained          versions in the measured window
  seconds_per_version       window seconds / versions_trained
  collective_share          versions producers took over the collective path / versions
                            they took in the window (goal 1.0; 'file' is the durable copy)
  trainer_egress_over_model_bytes   bytes sent by the trainer hosts' NICs per version /
                            the model's bytes (safetensors): the weight fan-out's cost,
                            plus Kafka fetch requests, metrics and, with several trainer
                            hosts, the trainer's own gradient traffic
  trainer_egress_by_host_over_model_bytes   the same per trainer host (rank 0's host sends
                            the versions; another's is its share of the gradient and
                            parameter collectives and its Kafka traffic)
  nic_rate_mbit, hosts, trainer_hosts, producer_tp

--smoke: compose, one producer, two versions (about a minute on 2 cores). Needs root
(network namespaces); otherwise it prints {"skipped": reason}. stdout carries
only the JSON; logs go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
log = logging.getLogger("bench.cluster")


def versions_taken(producer) -> tuple[float, float]:
    """(all, collective) versions a producer took, from one scrape: read apart, a version
    taken between the two reads made collective_share exceed 1 (1.333 in a smoke run)."""
    from rlstream.harness.observe import metric_value

    text = producer.scrape()
    name = "rlstream_producer_weight_versions_total"
    return metric_value(text, name), metric_value(text, name, transport="collective")


def model_bytes(run) -> int:
    """The policy's bytes as the trainer loaded them (the deployment's model.path)."""
    return sum(p.stat().st_size for p in run.model_dir().glob("*.safetensors"))


def measure(layout: str, trainers: int, producers: int, versions: int, rate_mbit: float, tp2: bool,
            root: Path) -> dict:
    from rlstream.harness.rehearsal.base import SWAPS, TP2_PRODUCER
    from rlstream.harness.rehearsal.compose import ComposeOnTwin
    from rlstream.harness.rehearsal.k8s import K8S_CONFIG_SWAPS, K8S_SWAPS, K8sOnTwin
    from rlstream.harness.rehearsal.systemd import SystemdOnTwin
    from rlstream.harness.supervisor import wait_until

    penv = {0: TP2_PRODUCER} if tp2 else {}
    kw = {"producers": producers, "rate_mbit": rate_mbit, "producer_env": penv}
    deployment = {"compose": lambda: ComposeOnTwin(root, **kw),
                  "systemd": lambda: SystemdOnTwin(root, trainers=trainers, **kw),
                  "k8s": lambda: K8sOnTwin(root, **kw)}[layout]()
    swaps = {"k8s": {"config": {k: v for k, (v, _) in K8S_CONFIG_SWAPS.items()}, **K8S_SWAPS}}.get(layout, SWAPS)
    with deployment as run:
        trainer_hosts = [s.name for s in run.ranks]

        def egress() -> dict[str, int]:
            return {h: run.twin.nic_bytes(h)[1] for h in trainer_hosts}

        wait_until(lambda: run.version() >= 1, 600, "the first version", run.services, interval_s=1)
        v0 = run.version()
        taken0 = {p.name: versions_taken(p) for p in run.producers}
        tx0, t0 = egress(), time.monotonic()
        wait_until(lambda: run.version() >= v0 + versions, 60 + 120 * versions, f"{versions} more versions",
                   run.services, interval_s=0.5)
        v1, t1, tx1 = run.version(), time.monotonic(), egress()
        # the served version, not the count taken: a producer that joined late (a TP=2 engine
        # starts minutes after the others) took fewer versions than the version number
        wait_until(lambda: all(p.try_metric("rlstream_producer_policy_version", 0) >= v1 for p in run.producers),
                   120, "the producers to take the last version", run.services)
        taken1 = {p.name: versions_taken(p) for p in run.producers}
        took = sum(taken1[n][0] - taken0[n][0] for n in taken0)
        collective = sum(taken1[n][1] - taken0[n][1] for n in taken0)
        trained, mb = v1 - v0, model_bytes(run)
        return {
            "versions_trained": int(trained),
            "seconds_per_version": round((t1 - t0) / trained, 3),
            "collective_share": round(collective / took, 3) if took else None,
            "trainer_egress_over_model_bytes": round((sum(tx1.values()) - sum(tx0.values())) / trained / mb, 3),
            "trainer_egress_by_host_over_model_bytes": {h: round((tx1[h] - tx0[h]) / trained / mb, 3)
                                                        for h in trainer_hosts},
            "model_bytes": mb,
            "nic_rate_mbit": rate_mbit,
            "layout": layout,
            "hosts": [h.name for h in run.twin.hosts],
            "trainer_hosts": len(trainer_hosts),
            "producer_tp": [2 if tp2 and i == 0 else 1 for i in range(producers)],
            "shaping_note": sorted({s.note for s in run.twin.shaping.values() if s.note}),
            "swaps": swaps,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=["compose", "systemd", "k8s"], default="compose")
    ap.add_argument("--trainers", type=int, default=2, help="systemd layout: trainer hosts (k8s: the JobSet's)")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--tp2", action="store_true", help="producer-0 at tensor_parallel_size 2 (routing off)")
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--smoke", action="store_true", help="one producer, two versions")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.smoke:
        args.layout, args.producers, args.versions = "compose", 1, 2
    from rlstream.cluster.twin import unavailable_reason

    why = unavailable_reason()
    if why:
        print(json.dumps({"skipped": f"no cluster twin here: {why}"}))
        return 0
    with tempfile.TemporaryDirectory(prefix="rlstream-bench-cluster-") as d:
        out = measure(args.layout, args.trainers, args.producers, args.versions, args.rate_mbit, args.tp2, Path(d))
    out["smoke"] = args.smoke
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
