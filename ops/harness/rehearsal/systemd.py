"""SystemdOnTwin: the ops/systemd/ units on a cluster twin (broker, trainer-0..N-1 as one
torchrun job across hosts, producer-i hosts), with the swaps of base.py."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from rlstream.cluster.shipped import ShippedService, systemd_service
from rlstream.harness.rehearsal.base import (
    CONSUMER_SWAPS,
    PRODUCER_SWAPS,
    ROOT,
    Rehearsal,
    ShippedOnTwin,
    service_env,
)

UNITS = ROOT / "ops" / "systemd"


def producer_copy_unit(template: ShippedService, i: int) -> ShippedService:
    """producer-i from the producer unit, as its header says: its own RLSTREAM__PRODUCER__PRODUCER_ID."""
    env = dict(template.environment, RLSTREAM__PRODUCER__PRODUCER_ID=f"producer-{i}")
    return replace(template, name=f"producer-{i}", environment=env)


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
