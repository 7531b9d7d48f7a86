"""The compose deployment as shipped, started on a cluster twin: each service on a host of its own.

Shared by tests/integration/test_deployment_twin.py (does it train across
hosts?) and tests/bench/cluster.py (how fast, how many bytes). The commands and
environments come from ops/compose/docker-compose.yml through
common/cluster/shipped.py; the only changes are the swaps below, each one a
device or packaging difference between a GPU node with containers and this
CPU machine, never a setting the deployment gets wrong. More producers than
the file ships are made the way its header tells users to: copies of
producer-1 with a new name and producer id.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from common.cluster.shipped import ShippedService, compose_services
from common.cluster.twin import ClusterTwin, Host
from common.harness.supervisor import Service, child_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
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


def producer_copy(template: ShippedService, i: int) -> ShippedService:
    """producer-i made from producer-1 as the compose file's header says: new name, new producer id."""
    env = dict(template.environment, RLSTREAM__PRODUCER__PRODUCER_ID=f"producer-{i}")
    return ShippedService(f"producer-{i}", list(template.command), env, template.working_dir)


class ComposeOnTwin:
    """kafka, consumer and `producers` producer hosts; NICs at `rate_mbit` (None: unshaped).

        with ComposeOnTwin(tmp_path, producers=2) as run:
            run.consumer.metric("rlstream_consumer_policy_version")
    """

    def __init__(self, root: Path, producers: int = 2, rate_mbit: float | None = None,
                 consumer_env: dict[str, str] | None = None, start_timeout_s: float = 300):
        self.work, self.logs = root / "volume", root / "logs"
        self.num_producers, self.start_timeout_s = producers, start_timeout_s
        self.consumer_env = {**CONSUMER_SWAPS, **(consumer_env or {})}
        self.token = "twin-" + os.urandom(8).hex()
        self.shipped = compose_services(COMPOSE, {"RLSTREAM_CONFIG": str(ROOT / "configs" / "tiny-cpu.yaml"),
                                                  "RLSTREAM_ADMIN_TOKEN": self.token})
        names = ["kafka", "consumer"] + [f"producer-{i}" for i in range(producers)]
        self.twin = ClusterTwin([Host(n, rate_mbit=rate_mbit) for n in names], observer=True)
        self.consumer: ShippedOnTwin | None = None
        self.producers: list[ShippedOnTwin] = []
        self._stack = ExitStack()

    @property
    def services(self) -> list[Service]:
        return [s for s in (self.consumer, *self.producers) if s is not None]

    def __enter__(self) -> "ComposeOnTwin":
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self._stack.enter_context(self.twin)
        self._stack.callback(self._stop_services)
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self) -> None:
        from common.kafka.broker import kafka_ping

        log = open(self.logs / "kafka.log", "wb")
        self._stack.callback(log.close)
        self.twin.popen("kafka", [sys.executable, "-m", "common.app.cli", "broker", "--set", "broker.host=kafka",
                                  "--set", "broker.port=9092"], cwd=ROOT, env=service_env({}, {}),
                        stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: kafka_ping(self.twin.address("kafka"), 9092, 0.5), 60, "the broker on host kafka")
        init = self.shipped["init"]
        r = self.twin.run("consumer", ["sh", "-c", 'cd "$0" && exec "$@"', str(self.work), *init.command],
                          timeout=300, env=service_env(init.environment, {}))
        if r.returncode != 0:
            raise RuntimeError(f"compose service init failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
        self.consumer = ShippedOnTwin(self.twin, self.shipped["consumer"], "consumer", self.logs, self.work,
                                      self.consumer_env).start()
        ncpu = os.cpu_count() or 1
        for i in range(self.num_producers):
            shipped = self.shipped.get(f"producer-{i}") or producer_copy(self.shipped["producer-1"], i)
            extra = {**PRODUCER_SWAPS, "VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)}
            self.producers.append(ShippedOnTwin(self.twin, shipped, "producer", self.logs, self.work, extra).start())
        for s in self.services:
            s.wait_ready(timeout_s=self.start_timeout_s)

    def _stop_services(self) -> None:
        for s in reversed(self.services):
            if s.alive:
                s.stop(timeout_s=60)

    def version(self) -> float:
        return self.consumer.try_metric("rlstream_consumer_policy_version", 0)

    def versions_taken(self, producer: Service, transport: str | None = None) -> float:
        labels = {"transport": transport} if transport else {}
        return producer.try_metric("rlstream_producer_weight_versions_total", 0, **labels)
