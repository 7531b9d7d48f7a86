"""Hostile HTTP clients on loopback, for the endpoint tests and the hostile bench: a raw
exchange, slow clients that trickle their request, and a flood of connections at once.

    exchange            send bytes on a fresh connection, read to the close: (answer, seconds)
    Trickler            n connections that send a head, then one byte of a tail a second
    flood_connections   n non-blocking connections at once, each sends a request and reads to the close
"""
from __future__ import annotations

import selectors
import socket
import threading
import time


def exchange(port: int, data: bytes, timeout: float) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, read until the server closes: (answer, seconds)."""
    t0 = time.monotonic()
    out = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
            c.sendall(data)
            while chunk := c.recv(65536):
                out += chunk
    except OSError:
        pass  # a refused, reset or timed-out connection: whatever came is the answer
    return out, time.monotonic() - t0


class Trickler:
    """`n` connections opened at once, each sent `head` and then one byte of `tail` a second."""

    def __init__(self, port: int, n: int, head: bytes, tail: bytes, seconds: float):
        self.port, self.n, self.head, self.tail, self.seconds = port, n, head, tail, seconds
        self.socks: list[socket.socket] = []
        self.opened, self.done = threading.Event(), threading.Event()

    def _open(self) -> None:
        try:  # connects in parallel: a connect stalled by a full backlog delays no other
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            self.socks.append(s)
            s.sendall(self.head)
        except OSError:
            pass  # refused at accept: the probes will tell

    def run(self) -> None:
        openers = [threading.Thread(target=self._open, daemon=True) for _ in range(self.n)]
        for t in openers:
            t.start()
        for t in openers:
            t.join(10)
        self.opened.set()
        t0 = time.monotonic()
        for i in range(int(self.seconds)):
            time.sleep(max(0.0, t0 + i + 1 - time.monotonic()))
            for s in list(self.socks):
                try:
                    s.sendall(self.tail[i % len(self.tail):][:1])
                except OSError:
                    pass
        self.done.set()

    def close(self) -> None:
        for s in self.socks:
            s.close()


def flood_connections(port: int, n: int, request: bytes, timeout: float) -> list[bytes]:
    """`n` connections opened at once (non-blocking), each sends `request` and reads to the close."""
    sel = selectors.DefaultSelector()
    out: dict[socket.socket, bytearray] = {}
    for _ in range(n):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        out[c] = bytearray()
        sel.register(c, selectors.EVENT_WRITE)
    deadline, open_ = time.monotonic() + timeout, n
    while open_ and time.monotonic() < deadline:
        for key, ev in sel.select(0.1):
            c = key.fileobj
            try:
                if ev & selectors.EVENT_WRITE:
                    c.sendall(request)
                    sel.modify(c, selectors.EVENT_READ)
                    continue
                chunk = c.recv(65536)
            except OSError:
                chunk = b""
            if chunk:
                out[c] += chunk
            else:
                sel.unregister(c)
                open_ -= 1
    for c in out:
        c.close()
    return [bytes(v) for v in out.values()]
