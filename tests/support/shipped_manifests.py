"""The deployments as shipped under ops/, read as data: the k8s documents (base and
monitoring overlay), their workloads' pods and containers, and the compose file's path
(test_ops.py, test_ops_cluster.py, test_memory_configs.py).

    k8s_docs            every k8s document, parsed once
    find                the one document of a kind and name
    pod_template        a Deployment's pod template, or a JobSet's replicated job's
    container           a workload's only container
    k8s_container_env   its literal env values, secrets as a placeholder
    torchrun_world      (nodes, processes per node) of a torchrun container
"""
from __future__ import annotations

import functools
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
K8S = OPS / "k8s"
COMPOSE = OPS / "compose" / "docker-compose.yml"


def load_yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@functools.lru_cache(maxsize=1)
def k8s_docs() -> tuple[dict, ...]:
    """The base's documents and the monitoring overlay's."""
    return tuple(d for p in sorted([*K8S.glob("*.yaml"), *K8S.glob("monitoring/*.yaml")])
                 if p.name != "kustomization.yaml" for d in load_yaml_docs(p))


def k8s_container_env(workload: dict) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "x")) for e in container(workload).get("env", [])}


def find(kind: str, name: str) -> dict:
    hits = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def pod_template(workload: dict) -> dict:
    """The pod template of a Deployment, or of a JobSet's (only) replicated job."""
    if workload["kind"] == "JobSet":
        (rjob,) = workload["spec"]["replicatedJobs"]
        return rjob["template"]["spec"]["template"]
    return workload["spec"]["template"]


def container(workload: dict) -> dict:
    (c,) = pod_template(workload)["spec"]["containers"]
    return c


def torchrun_world(workload: dict) -> tuple[int, int]:
    """(nodes, processes per node) of a torchrun container."""
    opts = dict(a.lstrip("-").split("=", 1) for a in container(workload)["args"] if a.startswith("--"))
    return int(opts["nnodes"]), int(opts["nproc_per_node"])
