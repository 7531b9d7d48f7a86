"""The fan-out group's byte path on CPU (gloo): a chunk-pipelined chain.

    plan = chain_plan(layout)                  # who receives from whom, who forwards to whom
    link = ChainLink.open(store, group_prefix(epoch), rank, layout.world_size, timeout_s)
    link.send(t)   # rank 0 (the trainer): chunks to rank 1 only
    link.recv(t)   # rank r > 0: chunk k from r-1, forwarded to r+1 while chunk k+1 arrives

Why a chain of our own: gloo has no pipelined broadcast. Its broadcast sends from the
root to every member, so the trainer's egress (and the time to deliver one version)
grows with the number of receivers: measured 0.806 and 1.9 x the model's bytes per
version at 1 and 2 producers (tests/bench/cluster.py). In a chain every rank sends each
byte at most once: the trainer's egress is 1x the model for any number of producers,
and with chunks small next to the version the last rank is a few chunks behind the
first (delivery time ~ bytes / NIC rate + ranks x chunk / rate). On GPU the same group
runs vLLM's `nccl` engine instead: NCCL pipelines its broadcast itself (rings/trees), so
the trainer sends once there too (consumer/weights/nccl.py `open_nccl_link`).

The group is the trainer plus every worker of every member producer, ranks from
common/weights/link.py `group_layout` (the same sizing and rank offsets as vLLM's nccl),
and each rank forwards to the next one: a TP=2 producer's second worker receives from
its first. A relay whose forward fails (the next rank died) keeps receiving for itself:
a dead member costs the ranks before it nothing; those after it fail their receive and
re-enter through their own link (consumer/weights/sender.py).

`ChainLink` has GlooPair's interface (send, recv, send_bytes, recv_bytes, close), so
`send_version` / `receive_version` (common/weights/link.py) and their digests run
unchanged on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.link import ROOT, Framed, GroupLayout

CHUNK_BYTES = 1 << 20
"""Pipelining grain: the last of N ranks trails the first by ~N chunks. 1 MiB keeps that
under 0.1 s at 100 Mbit/s for a few ranks, while a chunk still amortizes gloo's per-message cost."""
WINDOW = 4
"""Chunks in flight per direction: receives posted ahead, forwards not yet confirmed."""


def group_prefix(epoch: int) -> str:
    """The PrefixStore prefix of a fan-out group: a new one per epoch (each re-form), so a
    rank of an old group can never meet a rank of a new one in a rendezvous."""
    return f"{ROOT}fanout/{epoch}/pg/"


@dataclass(frozen=True)
class Hop:
    """One rank's place in the chain: it receives from `prev` and forwards to `next`."""

    rank: int
    prev: int | None
    next: int | None


def chain_plan(layout: GroupLayout) -> list[Hop]:
    """The chain over a group's ranks, in rank order (rank 0, the trainer, first): each
    producer's workers are contiguous (`group_layout`), so a producer's own workers follow
    each other and every hop but one per producer stays inside a producer."""
    n = layout.world_size
    return [Hop(r, r - 1 if r > 0 else None, r + 1 if r + 1 < n else None) for r in range(n)]


def _chunks(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    flat = t.reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return [flat]
    return [flat[o:o + chunk_bytes] for o in range(0, flat.numel(), chunk_bytes)]


class ChainLink(Framed):
    """One rank of a fan-out group on gloo (see the module doc)."""

    def __init__(self, pg, rank: int, world_size: int, timeout: timedelta, chunk_bytes: int = CHUNK_BYTES):
        self.pg, self.rank, self.world_size, self.timeout = pg, rank, world_size, timeout
        self.chunk_bytes = chunk_bytes
        hop = chain_plan(GroupLayout(world_size, ()))[rank]
        self.prev, self.next = hop.prev, hop.next
        self.sent_bytes = 0
        """Bytes this rank sent to the next one (rank 0: the trainer's egress)."""
        self.relay_error: str | None = None
        """Why this rank stopped forwarding (the next rank failed); it still receives."""
        self._tag = 0  # every rank sees the same chunk sequence, so tags agree
        self._forwards: list = []  # forwards not yet confirmed, across messages (see `flush`)

    @classmethod
    def open(cls, store, prefix: str, rank: int, world_size: int, timeout_s: float) -> "ChainLink":
        """Rendezvous on `prefix` (group_prefix(epoch)); blocks until every rank opens it."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        if not 0 <= rank < world_size:
            raise WeightTransferError(f"fan-out group {prefix}: rank {rank} is outside its group of {world_size}")
        timeout = timedelta(seconds=timeout_s)
        try:
            pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, world_size, timeout)
        except (RuntimeError, OSError) as e:
            raise WeightTransferError(f"fan-out group {prefix}: gloo rendezvous failed ({e})") from None
        return cls(pg, rank, world_size, timeout)

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % (1 << 30)
        return self._tag

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except (RuntimeError, OSError) as e:  # gloo: timeout, "Connection reset by peer", ...
            raise WeightTransferError(f"fan-out rank {self.rank}: {what} failed: {e}") from None

    def send(self, t: torch.Tensor) -> None:
        """Rank 0: stream `t` to rank 1, WINDOW chunks in flight."""
        if self.rank != 0:
            raise WeightTransferError(f"fan-out rank {self.rank} receives; only rank 0 sends")
        if self.next is None:
            return  # a group of the trainer alone (no producer): nothing to send
        pending = []
        for c in _chunks(t, self.chunk_bytes):
            pending.append(self.pg.send([c], self.next, self._next_tag()))
            self.sent_bytes += c.numel()
            if len(pending) >= WINDOW:
                self._wait(pending.pop(0), f"send to rank {self.next}")
        for w in pending:
            self._wait(w, f"send to rank {self.next}")

    def recv(self, t: torch.Tensor) -> torch.Tensor:
        """Rank > 0: receive `t` chunk by chunk from the previous rank, forwarding each chunk
        to the next rank as soon as it is in (while the following ones arrive)."""
        chunks = _chunks(t, self.chunk_bytes)
        tags = [self._next_tag() for _ in chunks]
        recvs = {k: self.pg.recv([chunks[k]], self.prev, tags[k]) for k in range(min(WINDOW, len(chunks)))}
        for k, c in enumerate(chunks):
            self._wait(recvs.pop(k), f"receive from rank {self.prev}")
            if k + WINDOW < len(chunks):
                recvs[k + WINDOW] = self.pg.recv([chunks[k + WINDOW]], self.prev, tags[k + WINDOW])
            self._forward(c, tags[k])
        # the last forwards stay in flight while the next message arrives: waiting for them here
        # drained the pipeline at every message (header, each group, each digest), measured
        # +0.25 s per hop for a 32 MiB version at 200 Mbit/s. `flush` confirms them.
        return t

    def flush(self) -> None:
        """Confirm every forward still in flight: call once a whole version is received, before
        its buffers can be reused (a pending forward still reads them)."""
        while self._forwards:
            self._settle(self._forwards.pop(0))

    def _forward(self, chunk: torch.Tensor, tag: int) -> None:
        if self.next is None or self.relay_error is not None:
            return
        try:
            self._forwards.append(self.pg.send([chunk], self.next, tag))
        except (RuntimeError, OSError) as e:
            self.relay_error = str(e)
            return
        self.sent_bytes += chunk.numel()
        if len(self._forwards) >= WINDOW:
            self._settle(self._forwards.pop(0))

    def _settle(self, work) -> None:
        """Wait for one forward; a failed one ends forwarding, not receiving (see the module doc)."""
        if self.relay_error is not None:
            return
        try:
            work.wait(self.timeout)
        except (RuntimeError, OSError) as e:
            self.relay_error = f"forward to rank {self.next} failed: {e}"

    def close(self) -> None:
        self._forwards.clear()
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - a broken group may refuse even this
            pass


__all__ = ["CHUNK_BYTES", "ChainLink", "Hop", "chain_plan", "group_prefix"]
