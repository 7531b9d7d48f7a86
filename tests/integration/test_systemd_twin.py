"""The systemd units, as shipped, on a cluster twin: a trainer on two hosts, a producer on a third.

The units of ops/systemd/ are read as systemd reads them (common/cluster/shipped.py:
ExecStart, Environment=, EnvironmentFile=, ${VAR} expansion) and run on their own
hosts: `rlstream-consumer.service` on trainer-0 and trainer-1 (torchrun across two
hosts, gloo, rendezvous at trainer-0 as torchrun.env says), `rlstream-producer.service`
on producer-0, and the broker unit on `broker`. The operator's files, which are not
shipped, are written as ops/systemd's install notes tell an operator to:
/etc/rlstream/rlstream.yaml is configs/tiny-cpu.yaml, /etc/rlstream/rlstream.env
points at the broker and sets the world size, /etc/rlstream/torchrun.env is the
shipped example with this twin's layout (2 x 1).

Swaps (device and paths only): /opt/rlstream -> this checkout's venv,
/etc/rlstream -> a temporary directory, /var/lib/rlstream -> one directory all hosts
share (the model and checkpoints on shared storage), the tiny model built once
before the units start (`rlstream build-model`, the install step), CPU threads, and
the tiny-model batch swaps of common/harness/rehearsal.py.

It trains VERSIONS versions; the producer on its own host must take every version
over the collective path. Before the units listened on all interfaces, it failed:
the weight endpoint and HTTP bound 127.0.0.1 on trainer-0.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from common.harness.rehearsal import CONSUMER_SWAPS, PRODUCER_SWAPS, ShippedOnTwin, service_env
from common.cluster.shipped import ShippedService, systemd_service
from common.cluster.twin import ClusterTwin, Host, unavailable_reason
from common.harness.supervisor import wait_until

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "ops" / "systemd"
VERSIONS = 5
_WHY = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.broker,
              pytest.mark.skipif(_WHY is not None, reason=f"no cluster twin here: {_WHY}")]


def _swap_paths(svc: ShippedService, etc: Path, name: str) -> ShippedService:
    def swap(text: str) -> str:
        return text.replace("/opt/rlstream/.venv/bin/", f"{Path(sys.executable).parent}/") \
                   .replace("/etc/rlstream/", f"{etc}/")
    return replace(svc, name=name, command=[swap(a) for a in svc.command],
                   environment={k: swap(v) for k, v in svc.environment.items()})


def _unit(unit: str, etc: Path, name: str, env_files: dict[str, str]) -> ShippedService:
    return _swap_paths(systemd_service(UNITS / unit, env_files), etc, name)


def _torchrun_env(node_rank: int) -> str:
    """The shipped example with this twin's layout: only the values change."""
    values = {"NNODES": "2", "NPROC_PER_NODE": "1", "NODE_RANK": str(node_rank), "MASTER_ADDR": "trainer-0",
              "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": ""}
    lines = []
    for line in (UNITS / "torchrun.env").read_text().splitlines():
        key = line.partition("=")[0].strip()
        lines.append(f"{key}={values[key]}" if key in values and not line.lstrip().startswith("#") else line)
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(900)
def test_systemd_units_train_across_hosts(tmp_path):
    etc, work, logs = tmp_path / "etc", tmp_path / "var-lib-rlstream", tmp_path / "logs"
    for d in (etc, work, logs):
        d.mkdir()
    shutil.copy(ROOT / "configs" / "tiny-cpu.yaml", etc / "rlstream.yaml")
    rlstream_env = "\n".join([
        "RLSTREAM_ADMIN_TOKEN=twin-token",
        "RLSTREAM__KAFKA__BOOTSTRAP_SERVERS=broker:9092",
        "RLSTREAM__BROKER__HOST=broker",            # the embedded broker on its own host (loopback by default)
        "RLSTREAM__BROKER__PORT=9092",
        "RLSTREAM__CONSUMER__PARALLEL__WORLD_SIZE=2",  # = NNODES x NPROC_PER_NODE of torchrun.env
        *(f"{k}={v}" for k, v in CONSUMER_SWAPS.items()),
        *(f"{k}={v}" for k, v in PRODUCER_SWAPS.items()),
    ]) + "\n"
    files = {"/etc/rlstream/rlstream.env": rlstream_env}
    trainers = [_unit("rlstream-consumer.service", etc, f"trainer-{r}",
                      {**files, "/etc/rlstream/torchrun.env": _torchrun_env(r)}) for r in range(2)]
    producer = _unit("rlstream-producer.service", etc, "producer-0", files)
    broker = _unit("rlstream-broker.service", etc, "broker", files)

    hosts = [Host("broker"), Host("trainer-0"), Host("trainer-1"), Host("producer-0")]
    with ClusterTwin(hosts, observer=True) as twin:
        r = twin.run("trainer-0", [str(Path(sys.executable).parent / "rlstream"), "build-model", "-c",
                                   str(etc / "rlstream.yaml")], cwd=work, timeout=300,
                     env=service_env(broker.environment, {}))
        assert r.returncode == 0, r.stderr[-2000:]
        with open(logs / "broker.log", "wb") as log:
            twin.popen("broker", ["sh", "-c", 'cd "$0" && exec "$@"', str(work), *broker.command],
                       env=service_env(broker.environment, {}), stdout=log, stderr=subprocess.STDOUT)
        from common.kafka.broker import kafka_ping
        wait_until(lambda: kafka_ping(twin.address("broker"), 9092, 0.5), 60, "the broker on host broker")
        ranks = [ShippedOnTwin(twin, t, "consumer", logs, work, {}).start() for t in trainers]
        prod = ShippedOnTwin(twin, producer, "producer", logs, work, {}).start()
        services = [*ranks, prod]
        try:
            ranks[0].wait_ready(timeout_s=300)
            prod.wait_ready(timeout_s=300)
            wait_until(lambda: ranks[0].try_metric("rlstream_consumer_policy_version", 0) >= VERSIONS, 600,
                       f"{VERSIONS} versions trained by the two-host trainer", services, interval_s=2)
            want = ranks[0].metric("rlstream_consumer_policy_version")
            taken = lambda t=None: prod.try_metric("rlstream_producer_weight_versions_total", 0,
                                                   **({"transport": t} if t else {}))
            wait_until(lambda: taken() >= want, 120, f"producer-0 to take version {want:.0f}", services)
            assert taken("collective") >= want and taken("file") == 0, (
                f"producer-0 took {taken('collective'):.0f} versions over the collective path and "
                f"{taken('file'):.0f} from the durable copy, of {want:.0f}\n{prod.log_tail(3000)}")
            assert ranks[1].alive, f"rank 1 on trainer-1 exited:\n{ranks[1].log_tail(2000)}"
        finally:
            for s in reversed(services):
                if s.alive:
                    s.stop(timeout_s=60)
