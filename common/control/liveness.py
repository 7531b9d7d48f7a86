"""Liveness means progress; readiness means initialised and connected.

    monitor = ProgressMonitor(stall_after_s=300)
    monitor.has_work("engine_step", engine.has_work())   # every loop iteration
    monitor.beat("engine_step")                          # each time the activity advances
    with monitor.operation("weight_update", limit_s=900):
        reloader.tick()                                  # a bounded operation of the loop
    live, reasons = monitor.check()                      # from the HTTP thread (/healthz)

A service's loop feeds the monitor; `/healthz` asks it from the HTTP thread,
so a loop wedged inside a call (an NCCL collective with no timeout, a hung
trainer rank) is seen by a thread that still runs. Not live means one of:

- an activity that has work has not advanced for `stall_after_s`. Its clock
  starts at the later of its last beat and the moment its work arrived, so a
  service idle for hours (no data, paused, held back) is not stalled the
  moment work comes; an activity without work is never stalled;
- a bounded operation has run longer than its limit. While one runs, its
  limit is the only bound (the loop is busy with it, not wedged elsewhere),
  and its time does not count toward any activity's stall.

Readiness (`/readyz`) is separate: `Readiness` answers ready once the
service called `initialised()` (engine loaded / model built, topics caught
up), while the broker answers, while every check the service added passes
(the consumer's: records wait on the broker and none arrive, consumer/stream/intake.py),
and until the service stops. Whether the broker answers is a real Kafka
request: a background thread sends an ApiVersions request every
`probe_every_s` (TLS when the cluster uses it), since a frozen broker (a
SIGSTOPped or wedged process) still accepts TCP connections: the kernel
completes the handshake. Its loss and its return are each logged once.
A not-ready service is taken out of load balancing, never restarted: a
dependency that cannot be reached is no reason to restart the loop, which
waits for it.

Metrics, evaluated at each scrape (so they move while the loop is wedged):
`rlstream_live` (1/0), `rlstream_loop_seconds_since_progress{activity}`,
`rlstream_ready` (1/0) and `rlstream_dependency_up{dependency="broker"}` (1/0,
the last probe).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

from rlstream.common import metrics
from rlstream.common.kafka.broker import probe_broker

if TYPE_CHECKING:
    import ssl

    from rlstream.common.config import KafkaSettings

log = logging.getLogger(__name__)

_LIVE = metrics.gauge("rlstream_live", "1 while the service's loop makes progress (GET /healthz 200), else 0")
_SINCE = metrics.gauge("rlstream_loop_seconds_since_progress",
                       "Seconds an activity with work has gone without advancing (a bounded operation: "
                       "how long it has run); 0 while idle", ["activity"])
_READY = metrics.gauge("rlstream_ready", "1 while the service is ready (GET /readyz 200), else 0")
_DEPENDENCY = metrics.gauge("rlstream_dependency_up", "1 while a dependency answers (the broker: a Kafka "
                            "ApiVersions request, probed every few seconds), else 0", ["dependency"])


class ProgressMonitor:
    """Activities the loop advances and bounded operations it runs; `check()` says whether it is live.

    Thread-safe: the loop writes, the HTTP thread reads. `clock` is injectable
    (seconds, monotonic) for tests; `export=False` keeps it off the metrics.
    """

    def __init__(self, stall_after_s: float, clock: Callable[[], float] = time.monotonic, export: bool = True):
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s must be > 0, got {stall_after_s}")
        self.stall_after_s, self._clock = stall_after_s, clock
        self._was_live = True
        self._lock = threading.Lock()
        self._beat: dict[str, float] = {}  # activity -> last beat
        self._work_since: dict[str, float] = {}  # activity -> when its current work arrived (absent: no work)
        self._ops: dict[str, tuple[float, float]] = {}  # running operation -> (started, limit_s)
        self._export = export
        self._exported_names: set[str] = set()
        if export:  # the newest monitor of the process answers the scrape
            _LIVE.set_function(lambda: 1.0 if self.check()[0] else 0.0)

    # ------------------------------------------------------------ fed by the loop

    def beat(self, name: str) -> None:
        """`name` advanced (a train step, an engine step)."""
        with self._lock:
            self._beat[name] = self._clock()
        self._exported(name)

    def has_work(self, name: str, waiting: bool) -> None:
        """Whether `name` has work now; its stall clock starts when work arrives."""
        with self._lock:
            if not waiting:
                self._work_since.pop(name, None)
            elif name not in self._work_since:
                self._work_since[name] = self._clock()
        self._exported(name)

    def started(self, name: str, limit_s: float) -> None:
        """A bounded operation began; not live if it has not `ended` within `limit_s`."""
        with self._lock:
            self._ops[name] = (self._clock(), limit_s)
        self._exported(name)

    def ended(self, name: str) -> None:
        with self._lock:
            op = self._ops.pop(name, None)
            if op is None:
                return
            t0, now = op[0], self._clock()
            # the operation had its own bound: its time moves every stall clock that ran through it
            for clocks in (self._beat, self._work_since):
                for activity, t in clocks.items():
                    if t <= t0:
                        clocks[activity] = t + (now - t0)

    @contextmanager
    def operation(self, name: str, limit_s: float) -> Iterator[None]:
        """`started` ... `ended` around a block, also when it raises."""
        self.started(name, limit_s)
        try:
            yield
        finally:
            self.ended(name)

    # ------------------------------------------------------------ asked by /healthz

    def check(self) -> tuple[bool, list[str]]:
        """(live, reasons it is not): every overdue operation, else every stalled activity."""
        now = self._clock()
        with self._lock:
            reasons = [f"{name} has run {now - t0:.0f} s, limit {limit:.0f} s"
                       for name, (t0, limit) in sorted(self._ops.items()) if now - t0 > limit]
            if not self._ops:
                reasons += [f"{name} has had work for {idle:.0f} s without progress (stall_after_s "
                            f"{self.stall_after_s:.0f})"
                            for name in sorted(self._work_since)
                            if (idle := now - self._stalled_since(name)) > self.stall_after_s]
            turned, self._was_live = self._was_live != (not reasons), not reasons
        if turned:  # once per change, not per probe
            log.log(logging.ERROR if reasons else logging.INFO, "liveness: %s",
                    "; ".join(reasons) if reasons else "live again")
        return not reasons, reasons

    def seconds_since_progress(self, name: str) -> float:
        """The gauge's value: how long `name` has waited (an operation: how long it has run); 0 idle."""
        now = self._clock()
        with self._lock:
            if name in self._ops:
                return now - self._ops[name][0]
            if name not in self._work_since or self._ops:
                return 0.0
            return max(0.0, now - self._stalled_since(name))

    def _stalled_since(self, name: str) -> float:
        return max(self._work_since[name], self._beat.get(name, 0.0))

    def _exported(self, name: str) -> None:
        """The gauge of `name`, once: its function reads this monitor at scrape time."""
        if self._export and name not in self._exported_names:
            self._exported_names.add(name)
            _SINCE.labels(activity=name).set_function(lambda: self.seconds_since_progress(name))

    def health(self, details: dict) -> tuple[bool, dict]:
        """What /healthz answers: (live, details plus the reasons when not live)."""
        live, reasons = self.check()
        return live, {**details, **({} if live else {"reasons": reasons})}


class Readiness:
    """Ready = initialised, the broker answers, every added check passes, not stopping (GET /readyz).

    `kafka`: the service's KafkaSettings (bootstrap servers and TLS settings), or
    bootstrap servers alone (plaintext). `check()` never blocks: the broker's
    state is the last probe's, made by a daemon thread from `initialised()` to
    `stopping()` / `close()`. `add_check(fn)`: `fn()` returns the reasons the
    service is not ready (a list of strings, empty when fine); it runs on the
    HTTP worker thread and at each scrape, so it must be cheap.
    """

    def __init__(self, kafka: "KafkaSettings | str", timeout_s: float = 1.0, probe_every_s: float = 2.0,
                 export: bool = True):
        self.bootstrap_servers = kafka if isinstance(kafka, str) else kafka.bootstrap_servers
        self._ssl = None if isinstance(kafka, str) else probe_ssl_context(kafka)
        self.timeout_s, self.probe_every_s = timeout_s, probe_every_s
        self._initialised = self._stopping = False
        self._broker_why: str | None = None  # the last probe's reason (None: it answered)
        self._checks: list[Callable[[], list[str]]] = []
        self._quit = threading.Event()
        self._prober: threading.Thread | None = None
        if export:  # the newest readiness of the process answers the scrape
            _READY.set_function(lambda: 1.0 if self.check()[0] else 0.0)
            _DEPENDENCY.labels(dependency="broker").set_function(lambda: 0.0 if self._broker_why else 1.0)

    def add_check(self, fn: Callable[[], list[str]]) -> None:
        self._checks.append(fn)

    def initialised(self) -> None:
        self._initialised = True
        if self._prober is None:
            self._probe_once()  # a known state before the first /readyz
            self._prober = threading.Thread(target=self._probe_loop, name="readiness-probe", daemon=True)
            self._prober.start()

    def stopping(self) -> None:
        self._stopping = True
        self._quit.set()

    close = stopping

    def check(self, details: dict | None = None) -> tuple[bool, dict]:
        reasons = []
        if not self._initialised:
            reasons.append("initialising")
        if self._stopping:
            reasons.append("stopping")
        if self._initialised and not self._stopping:
            if self._broker_why is not None:
                reasons.append(self._broker_why)
            for fn in self._checks:
                reasons += fn()
        return not reasons, {**(details or {}), **({"reasons": reasons} if reasons else {})}

    def _probe_loop(self) -> None:
        while not self._quit.wait(self.probe_every_s):
            self._probe_once()

    def _probe_once(self) -> None:
        why = broker_unanswered(self.bootstrap_servers, self.timeout_s, self._ssl)
        if (why is None) != (self._broker_why is None):  # once per change, not per probe
            log.log(logging.INFO if why is None else logging.ERROR, "readiness: %s",
                    "the broker answers again" if why is None else why)
        self._broker_why = why


def broker_unanswered(bootstrap_servers: str, timeout_s: float = 1.0,
                      ssl_context: "ssl.SSLContext | None" = None) -> str | None:
    """None when any bootstrap server answers a Kafka ApiVersions request within `timeout_s`;
    else the reason, naming each server. A raw request on a socket of its own: the HTTP thread
    must not share the loop's (not thread-safe) Kafka clients."""
    whys = []
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().split("://")[-1].rpartition(":")
        try:
            why = probe_broker(host.strip("[]") or "localhost", int(port), timeout_s, ssl_context)
        except ValueError:
            why = "is not host:port"
        if why is None:
            return None
        whys.append(f"{server.strip()} {why}")
    return "broker unreachable: " + "; ".join(whys)


def broker_reachable(bootstrap_servers: str, timeout_s: float = 1.0) -> bool:
    """Whether any bootstrap server answers a Kafka request within `timeout_s` (plaintext)."""
    return broker_unanswered(bootstrap_servers, timeout_s) is None


def probe_ssl_context(kafka: "KafkaSettings") -> "ssl.SSLContext | None":
    """The TLS context of the readiness probe, from the settings kafka-python's clients get
    (common/kafka/client.py `client_kwargs`); None for a plaintext protocol. An SASL listener
    answers ApiVersions before authentication, so the probe needs no credentials."""
    import ssl

    if kafka.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    ctx = ssl.create_default_context(cafile=kafka.ssl_cafile)
    if kafka.ssl_certfile:
        ctx.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile)
    ctx.check_hostname = kafka.ssl_check_hostname
    return ctx
