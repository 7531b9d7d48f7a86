"""The stand-in's transport: one TCP connection between every two ranks of a communicator.

    ring = Ring.open(store, rank, world_size, host)     # rendezvous on the bootstrap store
    ring.broadcast(buf, root)                           # NCCL's ring: chunks pipelined rank to rank
    ring.close()                                        # ncclCommAbort: every blocked call ends

Why not gloo: a gloo operation cannot be cancelled. An abort left its receive pending in
gloo's own threads, which then hung the process at exit or killed it with an uncaught
IoException once the peer's pair closed. Here every blocking call is a socket call of
the calling thread, and `close` shuts the sockets down, which ends it at once.

A broadcast goes round the ring from the root in 1 MiB chunks, each rank forwarding
chunk k while the next one arrives, as NCCL's ring broadcast does: the root sends each
byte once, whatever the number of ranks (the trainer's egress a GPU cluster sees).
Failures are reported as `PeerLost`: the caller (nccl.py) turns them into NCCL's
behaviour (the operation blocks until an abort).
"""
from __future__ import annotations

import socket
import struct
import threading
from datetime import timedelta

CHUNK = 1 << 20


class PeerLost(ConnectionError):
    """A peer's connection closed or broke (its process died, or the ring was closed)."""


class Ring:
    def __init__(self, rank: int, world_size: int, peers: dict[int, socket.socket]):
        self.rank, self.world_size, self.peers = rank, world_size, peers
        self.closed = threading.Event()

    @classmethod
    def open(cls, store, rank: int, world_size: int, host: str, timeout: timedelta) -> "Ring":
        """Connect to every other rank: to lower ranks, accept from higher ones."""
        listener = socket.create_server((host, 0), backlog=world_size)
        store.set(f"addr/{rank}", f"{host}:{listener.getsockname()[1]}")
        peers: dict[int, socket.socket] = {}
        try:
            for r in range(rank):
                store.wait([f"addr/{r}"], timeout)
                h, p = store.get(f"addr/{r}").decode().rsplit(":", 1)
                s = socket.create_connection((h, int(p)), timeout=timeout.total_seconds())
                s.sendall(struct.pack("<i", rank))
                peers[r] = s
            listener.settimeout(timeout.total_seconds())
            for _ in range(world_size - 1 - rank):
                s, _ = listener.accept()
                s.settimeout(timeout.total_seconds())
                peers[struct.unpack("<i", _recv_exact(s, 4))[0]] = s
        finally:
            listener.close()
        for s in peers.values():
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, world_size, peers)

    # -- operations (on raw bytes: memoryviews of the tensors' memory)

    def broadcast(self, buf: memoryview, root: int) -> None:
        order = [(root + i) % self.world_size for i in range(self.world_size)]
        at = order.index(self.rank)
        prev = order[at - 1] if at > 0 else None
        nxt = order[at + 1] if at + 1 < len(order) else None
        for i in range(0, len(buf), CHUNK):
            chunk = buf[i:i + CHUNK]
            if prev is not None:
                self._recv_into(prev, chunk)
            if nxt is not None:
                self._send(nxt, chunk)

    def send(self, buf: memoryview, dst: int) -> None:
        self._send(dst, buf)

    def recv(self, buf: memoryview, src: int) -> None:
        self._recv_into(src, buf)

    def close(self) -> None:
        self.closed.set()
        for s in self.peers.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _send(self, peer: int, buf: memoryview) -> None:
        try:
            self.peers[peer].sendall(buf)
        except OSError as e:
            raise PeerLost(f"rank {peer}: {e}") from None

    def _recv_into(self, peer: int, buf: memoryview) -> None:
        try:
            _recv_into(self.peers[peer], buf)
        except OSError as e:
            raise PeerLost(f"rank {peer}: {e}") from None


def _recv_into(s: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = s.recv_into(buf[got:])
        if n == 0:
            raise PeerLost("connection closed")
        got += n


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(s, memoryview(buf))
    return bytes(buf)
