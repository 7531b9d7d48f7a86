"""The cluster twin: hosts as network namespaces, one switch, shaped NICs.

A suite that runs on one host misses the bugs of a real cluster: a loopback
weight endpoint, a group sized for one worker, names that only resolve locally.
The twin makes "another host" real on one machine, without containers:

    switch namespace  <prefix>-switch: bridge br0, one port (v<i>) per host
    host namespace    <prefix>-<name>: eth0 = 10.<a>.<b>.<i+1>/24, lo up
    NIC shaping       tc on both ends of the host's veth: tbf at `rate_mbit`
                      (the host's egress on eth0, its ingress on the switch port),
                      netem `delay_ms` where the kernel has sch_netem
    names             /etc/netns/<ns>/hosts, which `ip netns exec` bind-mounts
                      over /etc/hosts: every host name (and alias) resolves to its
                      address in every host, as a cluster's DNS would
    processes         `ip netns exec <ns> unshare --uts` with hostname set to the
                      host's name, so socket.gethostname()/getfqdn() answer what a
                      pod's would, not the machine's
    observer          (optional) one more port on the switch for the machine itself,
                      10.<a>.<b>.254, so a test or an operator's browser can scrape
                      the services as Prometheus would; no forwarding, no route
                      beyond the /24

The addresses are private to the namespaces: nothing is routed to or from the
machine's own interfaces. Needs root (CAP_NET_ADMIN) and iproute2; where the kernel
refuses, `unavailable_reason()` says why and tests skip with it.

Namespaces are named `<prefix>-<host>`; a twin made by a test uses the prefix
`rlt<pid>-<n>`, and `up()` first removes namespaces left by a test process that no
longer runs (a SIGKILLed pytest cannot clean up after itself).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.common import process

log = logging.getLogger(__name__)

NETNS_ETC = Path("/etc/netns")
_serial = itertools.count()  # twins of one process get prefixes of their own
_TEST_PREFIX = re.compile(r"^rlt(\d+)-")


@dataclass(frozen=True)
class Host:
    """One machine of the twin: its DNS name, aliases (e.g. a k8s service name
    that points at it) and its NIC."""

    name: str
    rate_mbit: float | None = None
    """NIC bandwidth each way; None: unshaped (veth speed)."""
    delay_ms: float = 0.0
    """One-way latency added at the host's NIC (needs sch_netem)."""
    aliases: tuple[str, ...] = ()


@dataclass
class Shaping:
    """What the kernel accepted for one host's NIC."""

    rate_mbit: float | None
    delay_ms: float
    note: str = ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _in(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=check,
                          timeout=30)


def unavailable_reason() -> str | None:
    """None when this machine can build a twin; else why not (for pytest.skip)."""
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"rltprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"the kernel refused a network namespace: {r.stderr.strip()}"
        r = _in(probe, "ip", "link", "add", "br0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"no bridge support in this kernel: {r.stderr.strip()}"
        r = _in(probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100mbit", "burst", "64kb",
                "latency", "100ms", check=False)
        if r.returncode != 0:
            return f"tc cannot shape (sch_tbf missing): {r.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """SIGKILL what still runs in `ns`, then delete it and its /etc/netns files."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_stale_test_namespaces() -> list[str]:
    """Delete namespaces of twins whose test process is gone; return their names."""
    r = _ip("netns", "list", check=False)
    gone = []
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        m = _TEST_PREFIX.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            gone.append(ns)
    return gone


def _free_subnet(seed: int) -> str:
    """A 10.x.y.0/24 that no route of this machine covers (so the twin shadows nothing)."""
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    for k in range(1000):
        n = seed + k * 7919
        subnet = f"10.{231 + n % 20}.{n // 20 % 250}"
        if f"{subnet}." not in routes:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 for the cluster twin")


def remove(prefix: str) -> list[str]:
    """Delete every namespace `<prefix>-*` (a twin left up by `rlstream twin up`)."""
    r = _ip("netns", "list", check=False)
    gone = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(f"{prefix}-")]
    for ns in gone:
        _delete_namespace(ns)
    return gone


@dataclass
class ClusterTwin:
    """A set of hosts on one switch. Use as a context manager:

        with ClusterTwin([Host("broker"), Host("trainer-0", rate_mbit=1000)]) as twin:
            p = twin.popen("trainer-0", ["rlstream", "consumer", ...])
            twin.address("broker")   # '10.231.7.1'
    """

    hosts: list[Host]
    prefix: str = ""
    subnet: str = ""
    """First three octets of the /24, e.g. '10.231.7'; default derived from the pid."""
    observer: bool = False
    """Give this machine (the root namespace) a port on the switch at .254."""
    shaping: dict[str, Shaping] = field(default_factory=dict)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _up: bool = False

    def __post_init__(self):
        names = [h.name for h in self.hosts] + [a for h in self.hosts for a in h.aliases]
        if len(set(names)) != len(names):
            raise ValueError(f"host names and aliases must be unique: {names}")
        if len(self.hosts) > 250:
            raise ValueError("a twin has at most 250 hosts (one /24)")
        n = next(_serial)
        self.prefix = self.prefix or f"rlt{os.getpid()}-{n}"
        self.subnet = self.subnet or _free_subnet(os.getpid() * 16 + n)

    # ------------------------------------------------------------ addressing
    @property
    def switch(self) -> str:
        return f"{self.prefix}-switch"

    def ns(self, host: str) -> str:
        self._index(host)
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self._index(host) + 1}"

    @property
    def observer_address(self) -> str:
        return f"{self.subnet}.254"

    @property
    def _observer_dev(self) -> str:
        return f"rlo{self.prefix[3:]}"[:15] if self.prefix.startswith("rlt") else f"rlo-{self.prefix}"[:15]

    def _index(self, host: str) -> int:
        for i, h in enumerate(self.hosts):
            if h.name == host:
                return i
        raise KeyError(f"no host {host!r} in this twin (hosts: {[h.name for h in self.hosts]})")

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost"]
        lines += [" ".join([self.address(h.name), h.name, *h.aliases]) for h in self.hosts]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------ lifecycle
    def up(self) -> "ClusterTwin":
        remove_stale_test_namespaces()
        try:
            _ip("netns", "add", self.switch)
            self._up = True
            _in(self.switch, "ip", "link", "set", "lo", "up")
            _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _in(self.switch, "ip", "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                self._add_host(i, h)
            if self.observer:
                _ip("link", "add", "name", self._observer_dev, "type", "veth", "peer", "name", "obs",
                    "netns", self.switch)
                _in(self.switch, "ip", "link", "set", "obs", "master", "br0", "up")
                _ip("addr", "add", f"{self.observer_address}/24", "dev", self._observer_dev)
                _ip("link", "set", self._observer_dev, "up")
            for h in self.hosts:  # `ip netns exec` bind-mounts these over /etc/hosts
                (NETNS_ETC / self.ns(h.name)).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / self.ns(h.name) / "hosts").write_text(self.hosts_file())
        except BaseException:
            self.down()
            raise
        log.info("cluster twin %s up: %s", self.prefix,
                 ", ".join(f"{h.name}={self.address(h.name)}" for h in self.hosts))
        return self

    def _add_host(self, i: int, h: Host) -> None:
        ns, port = self.ns(h.name), f"v{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _in(self.switch, "ip", "link", "set", port, "master", "br0", "up")
        _in(ns, "ip", "link", "set", "lo", "up")
        _in(ns, "ip", "addr", "add", f"{self.address(h.name)}/24", "dev", "eth0")
        _in(ns, "ip", "link", "set", "eth0", "up")
        self.shaping[h.name] = self._shape(h, [(ns, "eth0"), (self.switch, port)])

    @staticmethod
    def _shape(h: Host, ends: list[tuple[str, str]]) -> Shaping:
        """tbf for the rate on both ends of the link (so the NIC is limited each
        way), netem for delay when the kernel has it (tbf as netem's child)."""
        if h.rate_mbit is None and not h.delay_ms:
            return Shaping(None, 0.0)
        note, delay = "", h.delay_ms
        for ns, dev in ends:
            parent = ["root"]
            if delay:
                r = _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                        f"{h.delay_ms}ms", check=False)
                if r.returncode == 0:
                    parent = ["parent", "1:1"]
                else:
                    note, delay = f"no delay: sch_netem unavailable ({r.stderr.strip()})", 0.0
            if h.rate_mbit is not None:
                # burst >= one 64 KiB GSO segment and >= 4 ms at the rate (the kernel's
                # tick), else tbf drops or stalls large segments on veth.
                burst = max(64 * 1024, int(h.rate_mbit * 1e6 / 8 * 0.004))
                _in(ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{h.rate_mbit}mbit",
                    "burst", str(burst), "latency", "200ms")
        return Shaping(h.rate_mbit, delay, note)

    def down(self) -> None:
        """Stop every process started here, then remove the namespaces."""
        for p in self._procs:
            _stop(p)
        self._procs.clear()
        for h in self.hosts:  # and whatever else was started in them (`exec`, a crashed test)
            _delete_namespace(f"{self.prefix}-{h.name}")
        _delete_namespace(self.switch)  # takes the observer's veth pair with it
        self._up = False

    def __enter__(self) -> "ClusterTwin":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def nic_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes on the host's NIC so far."""
        r = _in(self.ns(host), "ip", "-s", "-j", "link", "show", "eth0")
        stats = json.loads(r.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    # ------------------------------------------------------------ processes
    def command(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside `host`: its network namespace, and a UTS namespace whose
        hostname is the host's name."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv inside `host` in a session of its own; `down()` stops it, and
        it gets SIGTERM if this process dies first."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("preexec_fn", process.die_with_parent_hook())
        p = subprocess.Popen(self.command(host, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(host, argv), timeout=timeout, **kw)


def _stop(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace_s`."""
    if p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if p.poll() is not None:
                return
            time.sleep(0.1)
