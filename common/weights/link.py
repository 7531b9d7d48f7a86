"""One trainer-to-producer link of the collective weight path: rendezvous,
command channel, and the byte stream of a version (common/weights/wire.py).

Topology: the trainer (consumer rank 0) hosts one TCPStore at its endpoint
("host:port", named in every `WeightsReady` announcement). Each producer that
wants weights registers there and gets a link id; the link is a 2-rank gloo
group of its own (trainer rank 0, producer rank 1) on a PrefixStore of that
store. One group per producer, never one shared group: measured, one dead or
hung member of a shared group fails the collective for every member, while a
dead link only fails itself.

    producer                                   trainer (WeightSender)
    n = register(store, producer_id)   --->    acceptor sees join n, serves link n
    channel n: init / start / finish   <---    LinkClient posts commands, waits for acks
    GlooPair(rank 1): receive_version  <---    GlooPair(rank 0): send_version

Keys in the store (all under `rlstream/`): `joins` (counter), `link/<n>/who`,
`link/<n>/cmd/<k>` and `link/<n>/ack/<k>` (JSON), `link/<n>/pg/` (gloo's
rendezvous). Every blocking call has a timeout and raises
`WeightTransferError`; a gloo group that failed once is dead (gloo closes the
pair), so the caller drops the link and registers a new one.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch

from common.errors import ConfigError, WeightTransferError
from common.weights import wire

ROOT = "rlstream/"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"weight endpoint {endpoint!r} is not host:port")
    return host, int(port)


def open_store(host: str, port: int, timeout_s: float, master: bool = False):
    """The endpoint's TCPStore: hosted by the trainer (`master`), joined by producers."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=master, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout_s), multi_tenant=master)
    except (RuntimeError, OSError) as e:
        raise WeightTransferError(f"weight endpoint {host}:{port} unreachable: {e}") from None


def register(store, producer_id: str) -> int:
    """Ask the trainer for a link; returns its id (the trainer's acceptor serves it)."""
    n = int(store.add(ROOT + "joins", 1))
    store.set(f"{ROOT}link/{n}/who", producer_id)
    return n


def joins(store) -> int:
    """How many links were ever registered at this endpoint."""
    return int(store.add(ROOT + "joins", 0))


# ---------------------------------------------------------------- command channel


class Channel:
    """Numbered commands from the trainer, acknowledged by the producer, per link."""

    def __init__(self, store, link: int):
        self.store, self.link = store, link
        self._next_cmd = 0  # trainer side
        self._next_seen = 0  # producer side

    def _key(self, kind: str, k: int) -> str:
        return f"{ROOT}link/{self.link}/{kind}/{k}"

    def call(self, op: str, timeout_s: float, **args) -> dict:
        """Trainer side: post a command, wait for its ack; raises on an error ack or timeout."""
        k, self._next_cmd = self._next_cmd, self._next_cmd + 1
        self.store.set(self._key("cmd", k), json.dumps({"op": op, **args}))
        try:
            self.store.wait([self._key("ack", k)], timedelta(seconds=timeout_s))
            ack = json.loads(self.store.get(self._key("ack", k)))
        except (RuntimeError, OSError) as e:  # TCPStore reports timeouts as RuntimeError
            raise WeightTransferError(f"link {self.link}: no ack to {op!r} within {timeout_s:.0f} s ({e})") from None
        for kind in ("cmd", "ack"):
            self.store.delete_key(self._key(kind, k))
        if ack.get("error"):
            raise WeightTransferError(f"link {self.link}: the producer refused {op!r}: {ack['error']}")
        return ack

    def post(self, op: str, **args) -> None:
        """Trainer side: post a command without waiting for its ack (`close`)."""
        k, self._next_cmd = self._next_cmd, self._next_cmd + 1
        self.store.set(self._key("cmd", k), json.dumps({"op": op, **args}))

    def next_command(self) -> tuple[int, dict] | None:
        """Producer side, non-blocking (one store round trip): the next command, if posted."""
        key = self._key("cmd", self._next_seen)
        if not self.store.check([key]):
            return None
        k, self._next_seen = self._next_seen, self._next_seen + 1
        return k, json.loads(self.store.get(key))

    def ack(self, k: int, **result) -> None:
        self.store.set(self._key("ack", k), json.dumps(result))


# ---------------------------------------------------------------- the byte stream


@dataclass
class GlooPair:
    """A 2-rank gloo group: rank 0 (trainer) sends, rank 1 (producer) receives."""

    pg: object
    rank: int
    timeout: timedelta

    @classmethod
    def open(cls, store, link: int, rank: int, timeout_s: float) -> "GlooPair":
        """Rendezvous on the link's prefix; blocks until the other rank opens it too."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        timeout = timedelta(seconds=timeout_s)
        try:
            pg = ProcessGroupGloo(PrefixStore(f"{ROOT}link/{link}/pg/", store), rank, 2, timeout)
        except (RuntimeError, OSError) as e:
            raise WeightTransferError(f"link {link}: gloo rendezvous failed ({e})") from None
        return cls(pg, rank, timeout)

    def send(self, t: torch.Tensor) -> None:
        self._wait(self.pg.send([t], 1, 0), "send")

    def recv(self, t: torch.Tensor) -> torch.Tensor:
        self._wait(self.pg.recv([t], 0, 0), "receive")
        return t

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except (RuntimeError, OSError) as e:  # gloo: timeout, "Connection reset by peer", ...
            raise WeightTransferError(f"weight link {what} failed: {e}") from None

    def send_bytes(self, b: bytes) -> None:
        self.send(torch.tensor([len(b)], dtype=torch.int64))
        self.send(torch.frombuffer(bytearray(b), dtype=torch.uint8))

    def recv_bytes(self, limit: int = 64 << 20) -> bytes:
        n = int(self.recv(torch.zeros(1, dtype=torch.int64)).item())
        if not 0 <= n <= limit:
            raise WeightTransferError(f"weight link: a message of {n} bytes announced (limit {limit})")
        return self.recv(torch.empty(n, dtype=torch.uint8)).numpy().tobytes()

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - a broken group may refuse even this
            pass


def send_version(pair: GlooPair, header: wire.VersionHeader,
                 groups: Iterator[tuple[torch.Tensor, Callable[[], bytes]]]) -> bytes:
    """Stream one version: header, (buffer, digest) per group, version digest.

    `groups` yields each group's packed buffer and a callable returning its
    digest; the buffer goes out first, so hashing it overlaps its transfer.
    Returns the version digest.
    """
    pair.send_bytes(header.encode())
    digests = []
    for buf, get_digest in groups:
        pair.send(buf)
        d = get_digest()
        pair.send(torch.frombuffer(bytearray(d), dtype=torch.uint8))
        digests.append(d)
    if len(digests) != len(header.groups):
        raise WeightTransferError(f"sent {len(digests)} groups, the header announced {len(header.groups)}")
    vd = wire.version_digest(digests)
    pair.send(torch.frombuffer(bytearray(vd), dtype=torch.uint8))
    return vd


@dataclass
class ReceivedVersion:
    """A whole version in staging buffers, every digest checked."""

    header: wire.VersionHeader
    buffers: list[torch.Tensor]
    digest: str
    """The version digest (hex)."""
    seconds: float
    """Receive wall time (header to the last digest checked)."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor view) over every group, in stream order."""
        for spec, buf in zip(self.header.groups, self.buffers):
            yield from wire.unpack(buf, spec)


def receive_version(pair: GlooPair, pool: list[torch.Tensor] | None = None,
                    announced: str | None = None,
                    prepare: Callable[[wire.GroupSpec, torch.Tensor], None] | None = None) -> ReceivedVersion:
    """Receive one version into staging and check it; raises DigestMismatchError
    (after reading the whole stream, so the link stays usable) or WeightTransferError.

    Each group's digest is computed on a thread while the next group arrives.
    `prepare(spec, buf)`, if given, runs on another thread for each group as it
    arrives (before its digest is checked: it must only touch private state,
    which nobody uses unless the whole version verifies); it has finished when
    this returns. `pool`: buffers of the previous version, reused when their
    sizes match (warm pages: a fresh buffer's first-touch faults measured 4x slower).
    """
    t0 = time.perf_counter()
    header = wire.VersionHeader.decode(pair.recv_bytes())
    pool = list(pool or [])
    buffers, sent, pending, prepared = [], [], [], []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstream-verify") as hasher, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstream-prepare") as preparer:
        for spec in header.groups:
            buf = _take(pool, spec.nbytes)
            pair.recv(buf)
            pending.append(hasher.submit(wire.digest, buf))
            if prepare is not None:
                prepared.append(preparer.submit(prepare, spec, buf))
            sent.append(pair.recv(torch.empty(wire.DIGEST_BYTES, dtype=torch.uint8)).numpy().tobytes())
            buffers.append(buf)
        streamed = pair.recv(torch.empty(wire.DIGEST_BYTES, dtype=torch.uint8)).numpy().tobytes()
        got = [f.result() for f in pending]
        for f in prepared:
            f.result()
    for g, spec in enumerate(header.groups):
        wire.check_group(g, spec, got[g], sent[g], header.version)
    vd = wire.version_digest(got)
    wire.check_version(header.version, vd, streamed, announced)
    return ReceivedVersion(header, buffers, vd.hex(), time.perf_counter() - t0)


def _take(pool: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    for i, b in enumerate(pool):
        if b.numel() == nbytes:
            return pool.pop(i)
    return torch.empty(nbytes, dtype=torch.uint8)


__all__ = ["Channel", "GlooPair", "ReceivedVersion", "open_store", "parse_endpoint",
           "receive_version", "register", "send_version"]
