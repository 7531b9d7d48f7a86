"""The ranks' control channel: commands and batch shares from rank 0, over gloo.

    channel = RankChannel(dp_rank)             # collective: every rank, after Megatron's groups
    channel.send(code, text)                   # rank 0: one command (an int code and utf-8 text)
    code, text = channel.receive()             # ranks > 0: blocks until rank 0 sends one
    channel.send_shares(shares)                # rank 0: shares[d] to every rank of data-parallel rank d
    share = channel.receive_share()            # ranks > 0: its own BatchShare

Why a gloo group on the host. Followers wait here while rank 0 waits on
Kafka, for as long as the producers take (a batch of 32k-token groups can
take longer than 10 minutes). Waiting inside an NCCL collective ends in
NCCL's watchdog, which aborts the process after 10 minutes by default. A
gloo group has no watchdog thread, only the timeout each operation gets;
this group's is `WAIT_TIMEOUT`, made for it at start and independent of the
default group's. Gloo carries CPU tensors: each rank moves what it trains on
to its device itself. (consumer/ranks/protocol.py says what the commands mean.)

Wire. A command is a broadcast of int64[3] = [code, sequence number, text
bytes], then the text's utf-8 bytes when there are any. A share goes point to
point: int64[4] element counts, then the four tensors of consumer/ranks/shares.py
(empty ones skipped); tensor-parallel ranks of one data-parallel rank each get
the same share. Nothing is pickled. `received_bytes` counts what this rank
received, `last_share_bytes` the last share (rank_ingress_share).
"""
from __future__ import annotations

from datetime import timedelta

import torch

from rlstream.common.errors import RankProtocolError
from rlstream.consumer.train.batch import BatchShare
from rlstream.consumer.ranks.shares import pack, unpack

WAIT_TIMEOUT = timedelta(days=30)
"""How long a follower waits for rank 0's next command (rank 0 may wait on Kafka,
or be paused by an operator, for that long)."""
SHARE_DTYPES = (torch.int64, torch.int32, torch.float32, torch.uint8)
"""The element types of consumer/ranks/shares.py's four tensors, in order."""


class RankChannel:
    """One gloo group of every rank, and the data-parallel rank of each rank."""

    def __init__(self, dp_rank: int, timeout: timedelta = WAIT_TIMEOUT):
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        mine = torch.tensor([dp_rank], dtype=torch.int64)
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        self.dp_ranks = [int(t) for t in every]
        """Global rank -> its data-parallel rank."""
        self.seq = 0
        self.received_bytes = 0
        self.last_share_bytes = 0

    # ------------------------------------------------------------ commands

    def send(self, code: int, text: str = "") -> None:
        """Rank 0: one command to every other rank."""
        data = text.encode()
        self.seq += 1
        self._broadcast(torch.tensor([code, self.seq, len(data)], dtype=torch.int64))
        if data:
            self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> tuple[int, str]:
        """Ranks > 0: the next command (blocks, see the module docstring)."""
        head = self._broadcast(torch.zeros(3, dtype=torch.int64))
        code, seq, n = head.tolist()
        self.seq += 1
        if seq != self.seq:
            raise RankProtocolError(f"rank {self.rank}: command {seq} from rank 0, expected {self.seq}: "
                                    "a rank missed a command; restart every rank")
        text = bytes(self._broadcast(torch.zeros(n, dtype=torch.uint8)).numpy()).decode() if n else ""
        return code, text

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.broadcast(t, src=0, group=self.group)
        if self.rank != 0:
            self.received_bytes += t.numel() * t.element_size()
        return t

    # ------------------------------------------------------------ shares

    def send_shares(self, shares: list[BatchShare]) -> None:
        """Rank 0: to every other rank the share of its data-parallel rank."""
        packed = {d: pack(shares[d]) for d in set(self.dp_ranks[1:])}
        pending = []
        for dst in range(1, self.world):
            tensors = packed[self.dp_ranks[dst]].tensors
            sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
            for t in [sizes] + [t for t in tensors if t.numel()]:
                pending.append(self.dist.isend(t.contiguous(), dst=dst, group=self.group))
        for work in pending:
            work.wait()

    def receive_share(self) -> BatchShare:
        """Ranks > 0: this rank's share, sent by `send_shares`."""
        sizes = self._recv(torch.zeros(len(SHARE_DTYPES), dtype=torch.int64))
        tensors = [torch.empty(int(n), dtype=dt) for n, dt in zip(sizes.tolist(), SHARE_DTYPES)]
        for t in tensors:
            if t.numel():
                self._recv(t)
        self.last_share_bytes = sum(t.numel() * t.element_size() for t in [sizes] + tensors)
        return unpack(tensors)

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.recv(t, src=0, group=self.group)
        self.received_bytes += t.numel() * t.element_size()
        return t
