"""The cluster twin itself (ops/cluster/twin.py): hosts that are really apart.

- each host has its own address and hostname, and every host name (and alias)
  resolves to the right address in every host, as a cluster's DNS would;
- a host cannot reach another host's loopback: a service that binds or announces
  127.0.0.1 is unreachable from other hosts, the bug class the twin exists for;
- a shaped NIC bounds a transfer from below by its rate (a lower bound: this
  machine's load can only slow a transfer, never speed it past the NIC);
- the real broker on one host serves a Kafka client on another, by service name;
- a twin's namespaces are gone after it closes, and those of a dead test process
  are removed by the next twin.

Root and iproute2 are needed (CI runs as root); elsewhere these skip with the reason.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlstream.cluster.twin import ClusterTwin, Host, remove_stale_test_namespaces, unavailable_reason
from rlstream.harness.supervisor import Service

ROOT = Path(__file__).resolve().parents[2]
_WHY = unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"no cluster twin here: {_WHY}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_names_addresses_and_hostnames_resolve_per_host():
    with ClusterTwin([Host("node-a", aliases=("svc-a",)), Host("node-b")]) as twin:
        r = twin.run("node-b", _py("""
            import socket
            print(socket.gethostname(), socket.gethostbyname(socket.getfqdn()), socket.gethostbyname('svc-a'))
        """), timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["node-b", twin.address("node-b"), twin.address("node-a")]
        assert twin.ns("node-a") in _namespaces()
    assert not {twin.ns("node-a"), twin.ns("node-b"), twin.switch} & _namespaces()


def test_a_loopback_service_is_unreachable_from_another_host():
    """What N3 was: a weight endpoint announced as 127.0.0.1 reaches nobody else."""
    with ClusterTwin([Host("server"), Host("client")]) as twin:
        srv = twin.popen("server", _py("""
            import socket, time
            a = socket.create_server(('127.0.0.1', 7000)); b = socket.create_server(('0.0.0.0', 7001))
            time.sleep(30)
        """))
        client = _py("""
            import socket, sys
            ok = []
            for host, port in (('127.0.0.1', 7000), ('server', 7001)):
                for _ in range(50):
                    try:
                        socket.create_connection((host, port), timeout=1).close(); ok.append(True); break
                    except OSError:
                        import time; time.sleep(0.1)
                else:
                    ok.append(False)
            print(ok)
        """)
        r = twin.run("client", client, timeout=60)
        assert r.stdout.strip() == "[False, True]", (r.stdout, r.stderr)
        srv.kill()


def test_a_shaped_nic_bounds_the_transfer_rate():
    rate_mbit, nbytes = 40.0, 3 << 20   # 3 MiB at 40 Mbit/s: >= 0.63 s
    with ClusterTwin([Host("sink"), Host("source", rate_mbit=rate_mbit)]) as twin:
        assert twin.shaping["source"].rate_mbit == rate_mbit
        sink = twin.popen("sink", _py(f"""
            import socket, time
            srv = socket.create_server(('0.0.0.0', 7002)); c, _ = srv.accept()
            n, t0 = 0, None
            while n < {nbytes}:
                d = c.recv(1 << 20)
                if not d: break
                t0 = t0 or time.monotonic(); n += len(d)
            print(n, time.monotonic() - t0)
        """), stdout=subprocess.PIPE, text=True)
        r = twin.run("source", _py(f"""
            import socket, time
            for _ in range(50):
                try: s = socket.create_connection(('sink', 7002), timeout=2); break
                except OSError: time.sleep(0.1)
            s.sendall(b'x' * {nbytes}); s.close()
        """), timeout=60)
        assert r.returncode == 0, r.stderr
        got, seconds = sink.communicate(timeout=60)[0].split()
        floor = nbytes * 8 / (rate_mbit * 1e6)
        assert int(got) == nbytes
        # the first recv ends the idle burst; allow 25% for the token bucket's burst
        assert float(seconds) >= 0.75 * floor, f"{nbytes} B in {float(seconds):.3f} s on a {rate_mbit} Mbit/s NIC"


@pytest.mark.broker
@pytest.mark.timeout(300)
def test_the_broker_on_one_host_serves_a_client_on_another_by_name(tmp_path):
    config = tmp_path / "broker.yaml"
    config.write_text("{}\n")
    with ClusterTwin([Host("kafka-0", aliases=("kafka",)), Host("trainer-0")], observer=True) as twin, \
            Service("broker", config, tmp_path, sets=["broker.host=kafka", "broker.port=9092"],
                    launch=lambda argv: twin.command("kafka-0", argv)).start() as broker:
        client = _py("""
            import sys, time
            from rlstream.common.kafka.broker import kafka_ping
            deadline = time.monotonic() + 40
            while not kafka_ping('kafka', 9092, 0.5):
                if time.monotonic() > deadline: sys.exit('broker never answered')
                time.sleep(0.3)
            from kafka import KafkaConsumer, KafkaProducer
            from kafka.admin import KafkaAdminClient, NewTopic
            KafkaAdminClient(bootstrap_servers='kafka:9092').create_topics([NewTopic('twin', 1, 1)])
            p = KafkaProducer(bootstrap_servers='kafka:9092'); p.send('twin', b'across hosts').get(timeout=20)
            c = KafkaConsumer('twin', bootstrap_servers='kafka:9092', auto_offset_reset='earliest',
                              consumer_timeout_ms=15000)
            print(next(iter(c)).value.decode())
        """)
        r = twin.run("trainer-0", client, timeout=90, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip().endswith("across hosts")
        # the machine itself reaches the broker through the observer port, by address only
        from rlstream.common.kafka.broker import kafka_ping
        assert kafka_ping(twin.address("kafka-0"), 9092, 2.0)
        assert broker.alive, broker.log_tail()


def test_namespaces_of_a_dead_test_process_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"rlt{dead.pid}-0-orphan"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_stale_test_namespaces()
        assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
