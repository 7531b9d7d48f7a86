"""ComposeOnTwin: ops/compose/docker-compose.yml on a cluster twin (kafka, consumer,
producer-i hosts), with the swaps of base.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from rlstream.cluster.shipped import ShippedService, compose_services
from rlstream.harness.rehearsal.base import (
    COMPOSE,
    CONSUMER_SWAPS,
    PRODUCER_SWAPS,
    ROOT,
    Rehearsal,
    ShippedOnTwin,
    service_env,
)


def producer_copy(template: ShippedService, i: int) -> ShippedService:
    """producer-i made from producer-1 as the compose file's header says: new name, new producer id."""
    env = dict(template.environment, RLSTREAM__PRODUCER__PRODUCER_ID=f"producer-{i}")
    return ShippedService(f"producer-{i}", list(template.command), env, template.working_dir)


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
