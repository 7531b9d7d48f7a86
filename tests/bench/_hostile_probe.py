"""The health poller of tests/bench/hostile.py: /healthz and /readyz of every service, all run long.

    python tests/bench/_hostile_probe.py TARGETS OUT [--every-s 0.25] [--timeout-s 5]

A process of its own, so that the bench's own work (attack threads, Kafka
clients, hypothesis) never delays a probe: what it measures is the services.
TARGETS is a JSON file {service name: base URL}, read again whenever it
changes (a restarted service serves on a new port). One thread per (service,
path) sends `GET path` over a fresh connection every `--every-s` seconds and
appends one JSON line per probe to OUT:

    {"t": wall time at send, "svc": name, "path": "/healthz", "code": 200, "s": seconds,
     "over_cap": true when the answer is the connection cap's 503}

`code` 0: no answer within `--timeout-s` (then `s` is the timeout) or the
connection failed. The poller stops when its parent dies or on SIGTERM.
Not a bench (the leading underscore).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

PATHS = ("/healthz", "/readyz")


def probe(url: str, path: str, timeout_s: float) -> tuple[int, float, bool]:
    """(HTTP status or 0, seconds, answered by the connection cap) of one GET over a fresh connection."""
    u = urlsplit(url)
    t0 = time.monotonic()
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    out = b""
    try:
        with socket.create_connection((u.hostname, u.port), timeout=timeout_s) as c:
            c.settimeout(max(0.01, timeout_s - (time.monotonic() - t0)))
            c.sendall(head)
            while chunk := c.recv(65536):
                out += chunk
                if time.monotonic() - t0 > timeout_s:
                    break
    except OSError:
        pass  # refused, reset or timed out: whatever came is the answer
    seconds = time.monotonic() - t0
    try:
        code = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.") else 0
    except (IndexError, ValueError):
        code = 0
    return code, (seconds if code else max(seconds, timeout_s)), b"too many connections" in out


class Poller:
    def __init__(self, targets: Path, out: Path, every_s: float, timeout_s: float):
        self.targets_path, self.every_s, self.timeout_s = targets, every_s, timeout_s
        self.out = open(out, "a", buffering=1)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.targets: dict[str, str] = {}
        self._mtime = None

    def reload(self) -> None:
        try:
            mtime = self.targets_path.stat().st_mtime_ns
            if mtime != self._mtime:
                self.targets, self._mtime = json.loads(self.targets_path.read_text()), mtime
        except (OSError, ValueError):
            pass  # written again in a moment: keep the old targets

    def loop(self, svc: str, path: str) -> None:
        while not self.stop.is_set():
            t_next = time.monotonic() + self.every_s
            url = self.targets.get(svc)
            if url:
                t = time.time()
                code, seconds, over_cap = probe(url, path, self.timeout_s)
                line = {"t": round(t, 3), "svc": svc, "path": path, "code": code, "s": round(seconds, 4)}
                if over_cap:
                    line["over_cap"] = True
                with self.lock:
                    self.out.write(json.dumps(line) + "\n")
            self.stop.wait(max(0.0, t_next - time.monotonic()))

    def run(self) -> None:
        threads: dict[tuple[str, str], threading.Thread] = {}
        parent = os.getppid()
        while not self.stop.is_set() and os.getppid() == parent:
            self.reload()
            for svc in self.targets:
                for path in PATHS:
                    if (svc, path) not in threads:
                        threads[svc, path] = threading.Thread(target=self.loop, args=(svc, path), daemon=True)
                        threads[svc, path].start()
            self.stop.wait(0.5)
        self.stop.set()
        for t in threads.values():
            t.join(self.timeout_s + 1)
        self.out.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--every-s", type=float, default=0.25)
    ap.add_argument("--timeout-s", type=float, default=5.0)
    args = ap.parse_args()
    poller = Poller(args.targets, args.out, args.every_s, args.timeout_s)
    signal.signal(signal.SIGTERM, lambda *_: poller.stop.set())
    poller.run()


if __name__ == "__main__":
    main()
