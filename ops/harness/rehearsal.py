"""The shipped deployments, started on a cluster twin: each service on a host of its own.

    ComposeOnTwin   ops/compose/docker-compose.yml: kafka, consumer, producer-i hosts
    SystemdOnTwin   ops/systemd/ units: broker, trainer-0..N-1 (one torchrun job
                    across hosts), producer-i hosts
    K8sOnTwin       ops/k8s/ manifests: the Kafka Service's host, the consumer JobSet's
                    pods (one torchrun job across them), the producer Deployment's pods

Shared by tests/integration/test_deployment_twin.py, test_systemd_twin.py and
test_k8s_twin.py (do they train across hosts?) and tests/bench/cluster.py (how
fast, how many bytes).
Commands and environments come from the shipped files through
ops/cluster/shipped.py; the only changes are the swaps below, each one a
device or packaging difference between GPU nodes and this CPU machine, never a
setting the deployment gets wrong. More producers than a file ships are made the
way it tells users to: copies with a new name and producer id.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import yaml

from rlstream.cluster.shipped import (
    ShippedService,
    cluster_dns,
    compose_services,
    dockerfile_entrypoint,
    external_service_names,
    k8s_config_text,
    k8s_deployment,
    k8s_documents,
    k8s_jobset,
    k8s_service,
    systemd_service,
)
from rlstream.common import process
from rlstream.cluster.twin import ClusterTwin, Host
from rlstream.harness.supervisor import Service, child_env, wait_until

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "ops" / "compose" / "docker-compose.yml"
UNITS = ROOT / "ops" / "systemd"
K8S = ROOT / "ops" / "k8s"
CONFIGMAP = "rlstream-config"
DOCKERFILE = ROOT / "ops" / "Dockerfile"

SWAPS = {
    "kafka": "apache/kafka:3.9.0 -> `rlstream broker` (tansu) listening on kafka:9092",
    "RLSTREAM_CONFIG": "/etc/rlstream/configs/tiny-cpu.yaml -> <checkout>/configs/tiny-cpu.yaml",
    "working_dir": "/var/lib/rlstream (volume rlstream-data) -> a directory shared by the hosts",
    "GPUs": "deploy.resources devices (nvidia) -> CPU; OMP/MKL threads 1, producer-i bound to core i",
    "ENFORCE_EAGER": "RLSTREAM__PRODUCER__ENGINE__ENFORCE_EAGER false -> true (CUDA graphs are a GPU feature; "
                     "torch.compile on 2 CPU cores would take minutes)",
    "PATH": "the image's rlstream -> this checkout's venv (PYTHONPATH=<checkout>)",
    "run_file": "RLSTREAM__<ROLE>__RUN_FILE added so the harness finds each service's HTTP address",
    "tiny model": "consumer.groups_per_batch 32 -> 4 and consumer.dynamic_sampling auto -> off "
                  "(RLSTREAM__CONSUMER__*): the untrained tiny model scores 0 on almost every group, which the "
                  "zero-variance filter drops; a version then takes seconds on 2 cores, not minutes",
}
TP2_PRODUCER = {  # a producer at tensor_parallel_size 2 on CPU: routing capture is a TP-1 hook, one core per worker
    # quoted: environment values are YAML scalars, and a bare off is the boolean false, which
    # producer.engine.routing refuses ("Input should be 'auto', 'capture', 'native' or 'off'")
    "RLSTREAM__PRODUCER__ENGINE__TENSOR_PARALLEL_SIZE": "2", "RLSTREAM__PRODUCER__ENGINE__ROUTING": "'off'",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
CONSUMER_SWAPS = {"RLSTREAM__CONSUMER__GROUPS_PER_BATCH": "4", "RLSTREAM__CONSUMER__DYNAMIC_SAMPLING": "off"}
PRODUCER_SWAPS = {"RLSTREAM__PRODUCER__ENGINE__ENFORCE_EAGER": "true"}

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


def service_env(shipped_env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = child_env(1)  # thread counts, offline, unbuffered; drops the caller's RLSTREAM__*
    env.update(shipped_env)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


class ShippedOnTwin(Service):
    """A compose service as a supervised process on its twin host, with its own command line."""

    def __init__(self, twin: ClusterTwin, shipped: ShippedService, role: str, log_dir: Path, work: Path,
                 extra: dict[str, str]):
        super().__init__(role, COMPOSE, log_dir, name=shipped.name, env=service_env(shipped.environment, extra),
                         launch=lambda argv: twin.command(shipped.name, argv), address=twin.address(shipped.name))
        self.shipped, self.work = shipped, work
        self.run_key = f"RLSTREAM__{role.upper()}__RUN_FILE"

    def argv(self) -> list[str]:
        self.env[self.run_key] = str(self.run_path())
        return ["sh", "-c", 'cd "$0" && exec "$@"', str(self.work), *self.shipped.command]


def producer_copy(template: ShippedService, i: int) -> ShippedService:
    """producer-i made from producer-1 as the compose file's header says: new name, new producer id."""
    env = dict(template.environment, RLSTREAM__PRODUCER__PRODUCER_ID=f"producer-{i}")
    return ShippedService(f"producer-{i}", list(template.command), env, template.working_dir)


def producer_copy_unit(template: ShippedService, i: int) -> ShippedService:
    """producer-i from the producer unit, as its header says: its own RLSTREAM__PRODUCER__PRODUCER_ID."""
    env = dict(template.environment, RLSTREAM__PRODUCER__PRODUCER_ID=f"producer-{i}")
    return replace(template, name=f"producer-{i}", environment=env)


def _wait_stopped(service: Service, timeout_s: float = 60, after_record_s: float = 5) -> None:
    """Until `service` exits, or `after_record_s` after it wrote its stop record (drained,
    final counters), then SIGKILL what is left of its group. Why: a producer stopped after
    the trainer wrote its record and then took 20 s more to exit (its weight link re-dials
    the gone trainer until the dial times out, then aborts: "terminate called without an
    active exception"), nothing a rehearsal checks, 20 s of every twin test."""
    deadline = time.monotonic() + timeout_s
    while service.alive and service.final() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    grace = after_record_s if service.final() is not None else max(0.0, deadline - time.monotonic())
    _, killed = process.wait_or_kill(service.proc, grace)
    if killed:
        log.info("%s: still running %.0f s after its stop record: killed its process group", service.name, grace)


class Rehearsal(ABC):
    """What both deployments share: the twin, the broker host, start and stop, readings."""

    broker_host = "kafka"
    config_file = ROOT / "configs" / "tiny-cpu.yaml"
    """The configuration the services read (its relative paths land in the working directory)."""

    def __init__(self, root: Path, host_names: list[str], rate_mbit: float | None, start_timeout_s: float,
                 producer_env: dict[int, dict[str, str]] | None = None,
                 aliases: dict[str, list[str]] | None = None):
        self.work, self.logs = root / "volume", root / "logs"
        self.producer_env = producer_env or {}
        """Extra environment of producer i (e.g. TP2_PRODUCER): a scenario, not a swap."""
        self.start_timeout_s = start_timeout_s
        aliases = aliases or {}  # more DNS names of a host (k8s Services and pod FQDNs)
        self.twin = ClusterTwin([Host(n, rate_mbit=rate_mbit, aliases=tuple(aliases.get(n, ()))) for n in host_names],
                                observer=True)
        self.ranks: list[ShippedOnTwin] = []
        self.producers: list[ShippedOnTwin] = []
        self._stack = ExitStack()

    @property
    def consumer(self) -> ShippedOnTwin | None:
        """Rank 0: HTTP, metrics and the weight endpoint."""
        return self.ranks[0] if self.ranks else None

    @property
    def services(self) -> list[Service]:
        return [*self.ranks, *self.producers]

    def __enter__(self):
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self._stack.enter_context(self.twin)
        self._stack.callback(self._stop_services)
        try:
            self._start()
            for s in (self.consumer, *self.producers):
                s.wait_ready(timeout_s=self.start_timeout_s)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @abstractmethod
    def _start(self) -> None:
        """Start the broker, the trainer's ranks and the producers (not waiting for them)."""

    def _start_broker(self, argv: list[str], env: dict[str, str], port: int = 9092) -> None:
        from rlstream.common.kafka.broker import kafka_ping

        log = open(self.logs / f"{self.broker_host}.log", "wb")
        self._stack.callback(log.close)
        self.twin.popen(self.broker_host, ["sh", "-c", 'cd "$0" && exec "$@"', str(self.work), *argv], env=env,
                        stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: kafka_ping(self.twin.address(self.broker_host), port, 0.5), 60,
                   f"the broker on host {self.broker_host}")

    def _run_once(self, host: str, argv: list[str], env: dict[str, str]) -> None:
        """A one-shot install step (build the tiny model) on `host`."""
        r = self.twin.run(host, ["sh", "-c", 'cd "$0" && exec "$@"', str(self.work), *argv], timeout=300, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed on {host} ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")

    def _stop_services(self) -> None:
        """Every trainer rank at once, as the kubelets of a JobSet or the hosts' systemd
        would (a rank stopped alone left the others blocked in a collective until gloo's
        timeout), then the producers. (With the producers stopped first, rank 0 once sat in
        its weight links' close for consumer.weights.timeout_s; `WeightSender.close` now
        abandons those waits at once, consumer/weights/sender.py, so either order stops.)"""
        for group in (self.ranks, self.producers):  # each group signalled at once: they stop in parallel
            live = [s for s in group if s.alive]
            for s in live:
                s.terminate()
            for s in live:
                _wait_stopped(s)

    def model_dir(self) -> Path:
        """The policy's directory (model.path of the services' configuration)."""
        from rlstream.common.config import load_config

        return self.work / load_config(str(self.config_file), environ={}).model.path

    def version(self) -> float:
        return self.consumer.try_metric("rlstream_consumer_policy_version", 0)

    def versions_taken(self, producer: Service, transport: str | None = None) -> float:
        labels = {"transport": transport} if transport else {}
        return producer.try_metric("rlstream_producer_weight_versions_total", 0, **labels)


class ComposeOnTwin(Rehearsal):
    """kafka, consumer and `producers` producer hosts; NICs at `rate_mbit` (None: unshaped).

        with ComposeOnTwin(tmp_path, producers=2) as run:
            run.consumer.metric("rlstream_consumer_policy_version")
    """

    trainer_hosts = 1

    def __init__(self, root: Path, producers: int = 2, rate_mbit: float | None = None,
                 consumer_env: dict[str, str] | None = None, start_timeout_s: float = 300,
                 producer_env: dict[int, dict[str, str]] | None = None):
        super().__init__(root, ["kafka", "consumer"] + [f"producer-{i}" for i in range(producers)], rate_mbit,
                         start_timeout_s, producer_env)
        self.num_producers = producers
        self.consumer_env = {**CONSUMER_SWAPS, **(consumer_env or {})}
        self.token = "twin-" + os.urandom(8).hex()
        self.shipped = compose_services(COMPOSE, {"RLSTREAM_CONFIG": str(ROOT / "configs" / "tiny-cpu.yaml"),
                                                  "RLSTREAM_ADMIN_TOKEN": self.token})

    def _start(self) -> None:
        self._start_broker([sys.executable, "-m", "rlstream.cli", "broker", "--set", "broker.host=kafka",
                            "--set", "broker.port=9092"], service_env({}, {}))
        init = self.shipped["init"]
        self._run_once("consumer", init.command, service_env(init.environment, {}))
        self.ranks = [ShippedOnTwin(self.twin, self.shipped["consumer"], "consumer", self.logs, self.work,
                                    self.consumer_env).start()]
        ncpu = os.cpu_count() or 1
        for i in range(self.num_producers):
            shipped = self.shipped.get(f"producer-{i}") or producer_copy(self.shipped["producer-1"], i)
            extra = {**PRODUCER_SWAPS, "VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu), **self.producer_env.get(i, {})}
            self.producers.append(ShippedOnTwin(self.twin, shipped, "producer", self.logs, self.work, extra).start())


class SystemdOnTwin(Rehearsal):
    """broker, trainer-0..`trainers`-1 (one torchrun job, one rank per host, rendezvous at
    trainer-0) and `producers` producer hosts, each running its ops/systemd/ unit.

    The operator's files, which are not shipped, are written as the units' install
    notes say: /etc/rlstream/rlstream.yaml is configs/tiny-cpu.yaml; rlstream.env
    points at the broker, sets the world size and the tiny-model swaps;
    torchrun.env is the shipped example with this layout's values. Swaps:
    /opt/rlstream -> this checkout's venv, /etc/rlstream -> a directory of the
    run, /var/lib/rlstream -> one directory all hosts share (the model and the
    checkpoints on shared storage), the tiny model built once before the units
    start (`rlstream build-model`, the install step).
    """

    broker_host = "broker"

    def __init__(self, root: Path, trainers: int = 2, producers: int = 1, rate_mbit: float | None = None,
                 start_timeout_s: float = 300, producer_env: dict[int, dict[str, str]] | None = None):
        names = ["broker"] + [f"trainer-{r}" for r in range(trainers)] + [f"producer-{i}" for i in range(producers)]
        super().__init__(root, names, rate_mbit, start_timeout_s, producer_env)
        self.trainer_hosts, self.num_producers = trainers, producers
        self.etc = root / "etc"
        self.config_file = self.etc / "rlstream.yaml"

    def _unit(self, unit: str, name: str, env_files: dict[str, str]) -> ShippedService:
        def swap(text: str) -> str:
            return text.replace("/opt/rlstream/.venv/bin/", f"{Path(sys.executable).parent}/")\
                       .replace("/etc/rlstream/", f"{self.etc}/")
        svc = systemd_service(UNITS / unit, env_files)
        return replace(svc, name=name, command=[swap(a) for a in svc.command],
                       environment={k: swap(v) for k, v in svc.environment.items()})

    def torchrun_env(self, node_rank: int) -> str:
        """The shipped example with this layout: only the values change."""
        values = {"NNODES": str(self.trainer_hosts), "NPROC_PER_NODE": "1", "NODE_RANK": str(node_rank),
                  "MASTER_ADDR": "trainer-0", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": ""}
        lines = []
        for line in (UNITS / "torchrun.env").read_text().splitlines():
            key = line.partition("=")[0].strip()
            lines.append(f"{key}={values[key]}" if key in values and not line.lstrip().startswith("#") else line)
        return "\n".join(lines) + "\n"

    def rlstream_env(self) -> str:
        return "\n".join([
            "RLSTREAM_ADMIN_TOKEN=twin-" + os.urandom(8).hex(),
            "RLSTREAM__KAFKA__BOOTSTRAP_SERVERS=broker:9092",
            "RLSTREAM__BROKER__HOST=broker",             # the embedded broker on its own host (loopback by default)
            "RLSTREAM__BROKER__PORT=9092",
            f"RLSTREAM__CONSUMER__PARALLEL__WORLD_SIZE={self.trainer_hosts}",  # = NNODES x NPROC_PER_NODE
            *(f"{k}={v}" for k, v in {**CONSUMER_SWAPS, **PRODUCER_SWAPS}.items()),
        ]) + "\n"

    def _start(self) -> None:
        self.etc.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "configs" / "tiny-cpu.yaml", self.etc / "rlstream.yaml")
        files = {"/etc/rlstream/rlstream.env": self.rlstream_env()}
        broker = self._unit("rlstream-broker.service", "broker", files)
        self._run_once("trainer-0", [str(Path(sys.executable).parent / "rlstream"), "build-model", "-c",
                                     str(self.etc / "rlstream.yaml")], service_env(broker.environment, {}))
        self._start_broker(broker.command, service_env(broker.environment, {}))
        for r in range(self.trainer_hosts):
            unit = self._unit("rlstream-consumer.service", f"trainer-{r}",
                              {**files, "/etc/rlstream/torchrun.env": self.torchrun_env(r)})
            self.ranks.append(ShippedOnTwin(self.twin, unit, "consumer", self.logs, self.work, {}).start())
        template = self._unit("rlstream-producer.service", "producer-0", files)
        ncpu = os.cpu_count() or 1
        for i in range(self.num_producers):
            self.producers.append(ShippedOnTwin(self.twin, producer_copy_unit(template, i), "producer", self.logs,
                                                self.work, {"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu),
                                                            **self.producer_env.get(i, {})}).start())


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
        from rlstream.common.config import load_config
        from rlstream.toy.build import ensure_data, ensure_model

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
