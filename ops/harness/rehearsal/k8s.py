"""K8sOnTwin: the ops/k8s/ manifests on a cluster twin (the Kafka Service's host, the
consumer JobSet's pods as one torchrun job across them, the producer Deployment's pods),
with the ConfigMap's swaps (K8S_CONFIG_SWAPS, swap_config), K8S_SWAPS and those of base.py."""
from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import yaml

from rlstream.cluster.shipped import (
    cluster_dns,
    dockerfile_entrypoint,
    external_service_names,
    k8s_config_text,
    k8s_deployment,
    k8s_documents,
    k8s_jobset,
    k8s_service,
)
from rlstream.common.config import load_config
from rlstream.harness.rehearsal.base import (
    CONSUMER_SWAPS,
    PRODUCER_SWAPS,
    ROOT,
    SWAPS,
    Rehearsal,
    ShippedOnTwin,
    service_env,
)
from rlstream.toy.build import ensure_data, ensure_model

K8S = ROOT / "ops" / "k8s"
CONFIGMAP = "rlstream-config"
DOCKERFILE = ROOT / "ops" / "Dockerfile"

# The ConfigMap's rlstream.yaml on the twin: key -> (value, why). Each is the model, the
# device or the cluster's size; what decides whether the deployment works across hosts
# (weights.host / advertise_host, http hosts, ports, staleness, the transport) stays as shipped.
# With CONSUMER_SWAPS and PRODUCER_SWAPS (the environment, as in compose) and K8S_SWAPS.
K8S_CONFIG_SWAPS = {
    "kafka.security_protocol": ("PLAINTEXT", "SASL_SSL -> PLAINTEXT: tansu has no SASL/TLS listener"),
    "kafka.sasl_mechanism": (None, "no SASL (above)"),
    "kafka.sasl_plain_username": (None, "no SASL (above)"),
    "kafka.ssl_cafile": (None, "no TLS (above)"),
    "kafka.topics.replication_factor": (1, "3 -> 1: one broker"),
    "model.path": ("/models/tiny-model", "Qwen3-30B-A3B -> the tiny MoE (on the models volume)"),
    "model.build_tiny": (True, "the tiny MoE, put on the models volume before the pods start"),
    "producer.prompts.path": ("/models/data/train.jsonl", "math-4096 -> the tiny model's arithmetic task"),
    "producer.verifier": ("exact_match", "math -> the tiny task's verifier"),
    "producer.max_tokens": (8, "32768 -> 8: the tiny model's context"),
    "producer.engine.max_model_len": (128, "40960 -> 128: the tiny model's context"),
    "producer.engine.kv_cache_memory_bytes": (134217728, "40 GiB of GPU memory -> 128 MiB of host memory"),
    "producer.engine.dtype": ("float32", "bfloat16 -> float32: the CPU engine"),
    "producer.engine.tensor_parallel_size": (1, "2 GPUs -> 1 CPU process per pod on 2 cores "
                                                "(TP2_PRODUCER puts it back for one producer)"),
    "producer.engine.routing": ("auto", "native (a GPU output) -> auto: capture on CPU"),
    "producer.engine.weight_transfer": ("rlstream_gloo", "nccl -> rlstream_gloo: NCCL's CPU twin"),
    "consumer.weights.backend": ("rlstream_gloo", "nccl -> rlstream_gloo: NCCL's CPU twin"),
    "consumer.dtype": ("float32", "bfloat16 -> float32: as the CPU engine"),
    "consumer.parallel": ({"tensor": 1, "expert": 1}, "16 GPUs (2 nodes x 8, expert 8) -> 2 nodes x 1 "
                                                      "process (world_size: the JobSet's nodes, set at start)"),
    "consumer.num_threads": (1, "8 -> 1 thread per process on 2 cores"),
}
K8S_SWAPS = {
    "image": "registry.example.com/rlstream -> this checkout's venv (PATH, PYTHONPATH=<checkout>); the image's "
             "ENTRYPOINT (ops/Dockerfile) for a container without `command`; its WORKDIR -> a directory of the run",
    "volumes": "each volumeMount -> a directory of the run named after the volume (the ConfigMap's "
               "rlstream.yaml written there with K8S_CONFIG_SWAPS, the models volume filled with the tiny "
               "model and its task data); /dev/shm stays the machine's",
    "Kafka": "the Strimzi cluster behind rlstream-kafka-bootstrap.kafka.svc -> `rlstream broker` (tansu) "
             "on host kafka with that Service's names, at the bootstrap's port",
    "--nproc_per_node": "8 (GPUS_PER_NODE) -> 1 in the JobSet's torchrun args",
    "replicas": "the producer Deployment's 16 -> `producers`",
    "Secret": "rlstream-secrets -> a random admin token and an unused Kafka password (no SASL)",
    "GPUs": "nvidia.com/gpu and rdma/ requests -> CPU; OMP/MKL threads 1, producer i bound to core i",
    "run_file": SWAPS["run_file"],
}


def swap_config(text: str, swaps: dict[str, tuple[object, str]], mount: Callable[[str], str]) -> str:
    """The ConfigMap's YAML with `swaps` set (dotted keys; a dict value merges) and every
    path under a volume mount moved to the run's directory for that volume."""
    doc = yaml.safe_load(text)
    for key, (value, _why) in swaps.items():
        *parents, leaf = key.split(".")
        node = doc
        for k in parents:
            node = node.setdefault(k, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = {**node[leaf], **value}
        else:
            node[leaf] = value

    def paths(node):
        if isinstance(node, dict):
            return {k: paths(v) for k, v in node.items()}
        if isinstance(node, list):
            return [paths(v) for v in node]
        return mount(node) if isinstance(node, str) else node
    return yaml.safe_dump(paths(doc), sort_keys=False)


class K8sOnTwin(Rehearsal):
    """The manifests of `manifests` (ops/k8s/ by default) on a twin: host `kafka` for the
    ConfigMap's bootstrap Service, one host per pod of the consumer JobSet (the JobSet's
    torchrun across them: rendezvous at pod 0 by its subdomain name, gloo) and one per
    producer pod (`producers` replicas of the Deployment).

    Every host resolves the names cluster DNS would give (ops/cluster/shipped.py):
    each Service as <svc> and <svc>.<ns>.svc.cluster.local to the pod it selects, each
    JobSet pod as <pod>.<subdomain>[.<ns>.svc.cluster.local]. The containers run the
    manifests' command/args/env; the swaps are K8S_CONFIG_SWAPS (the config),
    CONSUMER_SWAPS and PRODUCER_SWAPS (the environment, as compose) and K8S_SWAPS.
    """

    broker_host = "kafka"

    def __init__(self, root: Path, producers: int = 2, rate_mbit: float | None = None,
                 start_timeout_s: float = 300, producer_env: dict[int, dict[str, str]] | None = None,
                 manifests: Path = K8S, model_from: Path | None = None):
        self.model_from = model_from
        """A built tiny model to copy onto the models volume (a test session's), else built there."""
        docs = k8s_documents(manifests)
        self.config_text = k8s_config_text(docs, CONFIGMAP)
        self.trainer = k8s_jobset(docs, "rlstream-consumer")
        self.producer = k8s_deployment(docs, "rlstream-producer", replicas=producers)
        self.bootstrap = yaml.safe_load(self.config_text)["kafka"]["bootstrap_servers"].split(",")[0]
        host, _, port = self.bootstrap.rpartition(":")
        self.broker_port = int(port)
        pods = self.trainer.pods + self.producer.pods
        aliases = cluster_dns(docs, pods, self.trainer.namespace)
        aliases["kafka"] = external_service_names(host, self.trainer.namespace)
        super().__init__(root, ["kafka"] + [p.name for p in pods], rate_mbit, start_timeout_s, producer_env,
                         aliases)
        self.trainer_hosts, self.num_producers = len(self.trainer.pods), producers
        mounts = [m for w in (self.trainer, self.producer) for m in w.container.get("volumeMounts") or []
                  if m["mountPath"] != "/dev/shm"]  # the machine's own /dev/shm serves
        self.volumes = {m["name"]: root / "mounts" / m["name"] for m in mounts}
        self.mounts = {m["mountPath"]: self.volumes[m["name"]] / m.get("subPath", "") for m in mounts}
        config = next(v["name"] for v in self.trainer.volumes if (v.get("configMap") or {}).get("name") == CONFIGMAP)
        self.config_file = next(self.mounts[m["mountPath"]] for m in mounts if m["name"] == config)
        """Where the pods read the ConfigMap's rlstream.yaml (its volume's mount, moved)."""
        self.secrets = {("rlstream-secrets", "admin-token"): "twin-" + os.urandom(8).hex(),
                        ("rlstream-secrets", "kafka-password"): "unused-no-sasl"}

    def mount(self, text: str) -> str:
        """A path under a volume mount -> the run's directory for that volume (longest mount first)."""
        for path in sorted(self.mounts, key=len, reverse=True):
            text = re.sub(rf"(?<![\w./-]){re.escape(path)}(?=/|$|\s)", str(self.mounts[path]), text)
        return text

    def _populate_models_volume(self) -> None:
        """storage.yaml's models volume is filled out of band before any pod starts: here
        with the tiny model (copied from `model_from`, else built) and its task data.
        In this process: `rlstream build-model` as a process of its own took 44 s at load 22."""
        cfg = load_config(str(self.config_file), environ={})
        if self.model_from is not None:
            shutil.copytree(self.model_from, cfg.model.path)
        ensure_model(cfg)
        ensure_data(cfg)

    def _pod(self, workload, pod, extra: dict[str, str]) -> ShippedOnTwin:
        """Start `pod`'s container on its host: its command line and env with the paths of
        the run's volumes, one process per trainer node (K8S_SWAPS["--nproc_per_node"])."""
        shipped = k8s_service(workload, pod, dockerfile_entrypoint(DOCKERFILE), self.secrets)
        argv = [re.sub(r"^--nproc_per_node=\d+$", "--nproc_per_node=1", self.mount(a)) for a in shipped.command]
        env = {k: self.mount(v) for k, v in shipped.environment.items()}
        role = "consumer" if workload is self.trainer else "producer"
        return ShippedOnTwin(self.twin, replace(shipped, command=argv, environment=env), role, self.logs,
                             self.work, extra).start()

    def _start(self) -> None:
        for path in self.volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        swaps = {**K8S_CONFIG_SWAPS,
                 "consumer.parallel.world_size": (self.trainer_hosts, "the JobSet's nodes x 1 process")}
        self.config_file.write_text(swap_config(self.config_text, swaps, self.mount))
        env = service_env({}, {})
        cli = [sys.executable, "-m", "rlstream.cli"]
        self._start_broker([*cli, "broker", "--set", f"broker.host={self.bootstrap.rpartition(':')[0]}",
                            "--set", f"broker.port={self.broker_port}"], env, port=self.broker_port)
        self._populate_models_volume()
        self.ranks = [self._pod(self.trainer, p, CONSUMER_SWAPS) for p in self.trainer.pods]
        ncpu = os.cpu_count() or 1
        for i, p in enumerate(self.producer.pods):
            extra = {**PRODUCER_SWAPS, "VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu), **self.producer_env.get(i, {})}
            self.producers.append(self._pod(self.producer, p, extra))
