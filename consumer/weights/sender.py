"""How each new version leaves the trainer (rank 0) on the collective path.

    sender = WeightSender(cfg.consumer.weights)      # hosts the endpoint, accepts links
    sender.publish(snapshot)                         # sent once to every producer; returns at once

`WeightSender` hosts the weight endpoint (common/weights/link.py): an acceptor
thread serves each producer that registers with a link thread of its own
(`_Link`), which opens a group of the trainer and that producer's workers (sized
from its registration: `group_layout`) through vLLM's trainer factory
(`rlstream_gloo`, or `nccl` on GPU) and sends it the current version at once: a
producer that joins late gets it without waiting for the next step or stalling
anyone. Once the producer holds the newest version, its link hands it over to
the fan-out group (consumer/weights/fanout.py): every later version is sent once
to all grouped producers together (a chunk-pipelined chain on gloo, vLLM's nccl
broadcast on GPU), so the trainer's egress per version is 1x the model, not one
copy per producer.

`topology="star"` keeps every producer on its own link for every version (each
link sends the whole version: egress P x the model); kept as the benchmark's
baseline (tests/bench/weights.py).

A producer whose transfer fails (a dead, hung or refusing producer: each blocking
step is bounded by `consumer.weights.timeout_s`) is counted, told to re-register and
dropped; `publish` never waits for any transfer: the training loop goes on while
versions stream, and a producer still busy with an older version gets the newest
one next (newest wins). The durable store is consumer/weights/durable.py.
"""
from __future__ import annotations

import logging
import threading
import time

from rlstream.common.config import WeightSyncSettings
from rlstream.common.errors import ConfigError, RlstreamError
from rlstream.common.weights import link as wlink
from rlstream.consumer import telemetry
from rlstream.consumer.weights.backend import trainer_backend
from rlstream.consumer.weights.client import LinkClient
from rlstream.consumer.weights.snapshot import Snapshot
from rlstream.consumer.weights.fanout import Fanout

log = logging.getLogger("rlstream.consumer")


class WeightSender:
    TOPOLOGIES = ("chain", "star")

    def __init__(self, settings: WeightSyncSettings, backend: str = "rlstream_gloo", topology: str = "chain"):
        if topology not in self.TOPOLOGIES:
            raise ValueError(f"weight topology {topology!r}: use one of {', '.join(self.TOPOLOGIES)}")
        self.settings, self.backend, self.topology = settings, backend, topology
        self.transport = trainer_backend(backend)
        """How every link and the fan-out group open and send (consumer/weights/backend.py), chosen once."""
        self.store = wlink.open_store(settings.host, settings.port, settings.timeout_s, master=True)
        wildcard = settings.host in ("0.0.0.0", "::", "")
        self.host = dialable_host(settings)  # what producers dial
        self.local_host = "127.0.0.1" if wildcard else settings.host
        self.endpoint = f"{self.host}:{self.store.port}"
        """What producers dial (announced in WeightsReady)."""
        self.current: Snapshot | None = None
        self.links: dict[int, _Link] = {}
        self.failures = 0
        self._cond = threading.Condition()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="rlstream-weights-accept", daemon=True)
        self._acceptor.start()
        self.fanout = Fanout(self)
        if topology == "chain":
            self.fanout.start()
        log.info("weight endpoint %s (%s)", self.endpoint, backend)

    def publish(self, snapshot: Snapshot) -> None:
        """Every link sends `snapshot` next (it may still be filling); returns at once."""
        with self._cond:
            self.current = snapshot
            self._cond.notify_all()

    def wait_delivered(self, version: int, timeout_s: float) -> bool:
        """Every live link has sent `version` (or a newer one), or timeout. For tests and benchmarks."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            return self._cond.wait_for(lambda: all(lk.sent >= version for lk in self.links.values()),
                                       max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop every link and the fan-out group. A transfer in flight is abandoned, not awaited:
        its producer may be gone already (pipelines stop the producers first), and one that is
        not takes the durable copy the trainer announces as it stops (announce.py)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for lk in list(self.links.values()):
            if lk.client is not None:
                lk.client.channel.abandon(self.store, "the trainer is closing")
        self._acceptor.join(timeout=5)
        for lk in list(self.links.values()):
            if lk.is_alive():
                lk.join(timeout=self.settings.timeout_s)
        if self.fanout.is_alive():
            self.fanout.join(timeout=self.settings.timeout_s)
        for lk in list(self.links.values()):
            lk.release_own()

    # ------------------------------------------------------------ links

    def _accept(self) -> None:
        seen = 0
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, 0.05):
                    return
            try:
                joined = wlink.joins(self.store)
            except (RuntimeError, OSError):  # the store is shutting down
                return
            for n in range(seen + 1, joined + 1):
                lk = _Link(self, n)
                with self._cond:
                    self.links[n] = lk
                lk.start()
            seen = joined

    def _next(self, lk: "_Link") -> Snapshot | None:
        """A link's next version: block until one newer than it has is published (None:
        closing, or, in a chain topology, it holds the newest and now belongs to the group).
        Decided under the lock the group takes its rounds with, so no version falls between."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self.current is not None and self.current.version > lk.sent)
                                or (self.topology == "chain" and lk.sent >= 0))
            if self._closed:
                return None
            if self.current.version > lk.sent:
                return self.current.acquire()
            lk.grouped = True
            self._cond.notify_all()
            return None

    def next_round(self) -> tuple[Snapshot, list["_Link"]] | None:
        """The group's next round: the newest version and the grouped links behind on it
        (in link order: a producer keeps its place, and its rank, while nobody leaves)."""
        def behind() -> list["_Link"]:
            v = self.current.version if self.current is not None else -1
            return [lk for _, lk in sorted(self.links.items()) if lk.grouped and lk.sent < v]
        with self._cond:
            self._cond.wait_for(lambda: self._closed or behind())
            return None if self._closed else (self.current.acquire(), behind())

    def delivered(self, links: list["_Link"], version: int) -> None:
        with self._cond:
            for lk in links:
                lk.sent, lk.count = max(lk.sent, version), lk.count + 1
            self._cond.notify_all()

    def drop(self, lk: "_Link", error: BaseException) -> None:
        """A grouped producer failed: tell it to re-register (best effort) and drop it."""
        lk.close_remote(str(error))
        lk.release_own()
        self._dropped(lk, error)

    def _supersede(self, lk: "_Link") -> None:
        """`lk`'s producer registered anew: it never reads its older links again (it marked them
        dead), so they are dropped now, not found out by a command's timeout at the next round."""
        with self._cond:
            old = [o for o in self.links.values() if o is not lk and o.producer == lk.producer and o.n < lk.n]
        for o in old:
            o.close_remote(f"superseded by link {lk.n}")
            o.release_own()
            self._dropped(o, None)
            log.info("weight link %d (%s) superseded by its producer's link %d", o.n, o.producer, lk.n)

    def _dropped(self, lk: "_Link", error: BaseException | None) -> None:
        with self._cond:
            if self.links.get(lk.n) is not lk:
                return
            self.links.pop(lk.n, None)
            if error is not None:
                self.failures += 1
            self._cond.notify_all()
        telemetry.WEIGHT_LINKS.set(len(self.links))
        if error is not None:
            telemetry.WEIGHT_LINK_FAILURES.inc()
            log.warning("weight link %d (%s) dropped after %d versions: %s", lk.n, lk.producer, lk.count, error)


def dialable_host(settings: WeightSyncSettings) -> str:
    """The host producers dial, refused when it names this machine's loopback while the endpoint
    listens on every interface (producers elsewhere): with `advertise_host` unset that is the FQDN,
    which /etc/hosts maps to 127.0.1.1 on many installs (Ubuntu, cloud-init `manage_etc_hosts`). The
    NCCL rendezvous would then listen where no other host reaches it, and every init time out."""
    import ipaddress
    import socket

    host = settings.advertised_host()
    if settings.advertise_host or settings.host not in ("0.0.0.0", "::", ""):
        return host
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise ConfigError(f"this host's name {host!r} does not resolve ({e}); set it to an address the producers "
                          "can dial", key="consumer.weights.advertise_host") from None
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ConfigError(f"this host's name {host!r} resolves only to loopback ({', '.join(sorted(addrs))}): producers "
                          "on other hosts could not reach the weight endpoint or the NCCL rendezvous; set it to an "
                          "address they can dial", key="consumer.weights.advertise_host")
    return host


class _Link(threading.Thread):
    """One producer's link: open it, send the current version, then every newer one until it
    holds the newest (chain topology: then the fan-out group sends; star: forever)."""

    def __init__(self, sender: WeightSender, n: int):
        super().__init__(name=f"rlstream-weights-link-{n}", daemon=True)
        self.sender, self.n = sender, n
        self.producer = "?"
        self.workers = 1
        """How many of the producer's workers receive (from its registration)."""
        self.sent, self.count = -1, 0
        self.client: LinkClient | None = None
        self.engine = None
        """The trainer engine sending to this producer: its own, then the group's."""
        self.grouped = False
        """Handed over to the fan-out group (consumer/weights/fanout.py), which sends from now on."""
        self._own = None  # this link's own engine (the group's is the group's to close)

    def run(self) -> None:
        error: BaseException | None = None
        try:
            # a store connection of this link's own: a blocking wait holds its connection
            store = wlink.open_store(self.sender.local_host, self.sender.store.port, self.sender.settings.timeout_s)
            self.client = LinkClient(store, self.n, self.sender.settings.timeout_s)
            reg = wlink.read_registration(store, self.n, self.sender.settings.timeout_s)
            self.producer, self.workers = reg.producer, reg.workers
            self.sender._supersede(self)
            while (snap := self.sender._next(self)) is not None:
                try:
                    self._send(snap)
                finally:
                    snap.release()
        except (RlstreamError, RuntimeError, OSError) as e:
            error = e
            self.close_remote(str(e))
        finally:
            if error is not None or not self.grouped:
                self.release_own()
                self.sender._dropped(self, error)
            # handed over: its own group stays open until the fan-out group forms with it

    def release_own(self) -> None:
        """Close this link's own group (handed over: the fan-out group sends from now on)."""
        own, self._own = self._own, None
        if own is not None:
            own.shutdown()

    def _send(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        if self._own is None:
            self.engine = self._own = self._open(snap)
            telemetry.WEIGHT_LINKS.set(len(self.sender.links))
            log.info("weight link %d: producer %s joined (%d workers)", self.n, self.producer, self.workers)
        self.sender.transport.send(self._own, snap, self.sender.settings.timeout_s)
        with self.sender._cond:
            self.sent, self.count = snap.version, self.count + 1
            self.sender._cond.notify_all()
        telemetry.WEIGHT_SEND_SECONDS.observe(time.perf_counter() - t0)

    def _open(self, snap: Snapshot):
        s = self.sender
        layout = wlink.group_layout([self.workers])  # the same sizing for both transports
        return s.transport.open(self.client, s.host, s.store.port, snap, layout, s.settings.timeout_s, link=self.n)

    def close_remote(self, reason: str) -> None:
        if self.client is None:
            return
        try:
            self.client.channel.post("close", reason=reason[:500])
        except (RuntimeError, OSError):  # best effort: the store may be gone
            pass
