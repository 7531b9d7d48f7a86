"""What every rehearsal shares (the package docstring lists the deployments): the
swaps of the environment (SWAPS, CONSUMER_SWAPS, PRODUCER_SWAPS, TP2_PRODUCER), a
shipped service as a supervised process on its twin host (ShippedOnTwin), and the
Rehearsal base class: the twin, the broker host, start and stop, readings.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from contextlib import ExitStack
from pathlib import Path

from rlstream.cluster.shipped import ShippedService
from rlstream.cluster.twin import ClusterTwin, Host
from rlstream.common import process
from rlstream.common.config import load_config
from rlstream.common.kafka.broker import kafka_ping
from rlstream.harness.supervisor import Service, child_env, wait_until

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "ops" / "compose" / "docker-compose.yml"

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
        return self.work / load_config(str(self.config_file), environ={}).model.path

    def version(self) -> float:
        return self.consumer.try_metric("rlstream_consumer_policy_version", 0)

    def versions_taken(self, producer: Service, transport: str | None = None) -> float:
        labels = {"transport": transport} if transport else {}
        return producer.try_metric("rlstream_producer_weight_versions_total", 0, **labels)
