"""The sending half of the collective weight path, on vLLM 0.32's weight-transfer framework.

    snap = Snapshot(version, source)            # source: a vLLM WeightSource (consumer/weight_source.py)
    sender.publish(snap)                        # link threads start streaming what is packed
    snap.fill()                                 # pack + hash group by group (collective on every rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LinkClient(...))   # per link
    engine.source = snap; engine.send_weights() # start -> stream -> finish (producer verified it)

`Snapshot` is one version packed for sending, a buffer and a blake3 digest per
layer group (common/weights/wire.py). It is filled once per version on the
training thread and read by every link (and the durable writer) on their own
threads: a group goes out as soon as it is packed and its digest follows once
hashed, so packing, hashing and sending overlap. It holds the version in host
memory (1x the weights' bytes on rank 0) until the next one replaces it, so a
producer that joins late gets the current version at once.

`RlstreamGlooTrainerEngine` (`rlstream_gloo`, the trainer half of
producer/transfer.py) streams a snapshot over one link's gloo pair; on GPU the
same link code drives vLLM's `nccl` trainer engine with the snapshot as its
source (`SnapshotSource`, groups copied to the device one tensor at a time).
`LinkClient` is vLLM's `VLLMWeightSyncClient` over the link's command channel.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource)

from common.errors import WeightTransferError
from common.weights import wire
from common.weights.link import Channel, GlooPair, open_store, send_version
from consumer.weight_source import MegatronSource

BACKEND = "rlstream_gloo"
WeightSource.register(MegatronSource)  # implements the interface without importing vLLM


def register() -> None:
    """Register the trainer-side `rlstream_gloo` with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:  # register_engine raises on a duplicate
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "RlstreamGlooTrainerEngine")


# ---------------------------------------------------------------- the packed version


class Snapshot:
    """One version, packed group by group; readable while it fills (see the module doc)."""

    def __init__(self, version: int, source, reuse: "Snapshot | None" = None):
        self.version, self.source = version, source
        meta = {m.name: m for m in source.metadata()}
        self.header = wire.VersionHeader(version, [
            wire.GroupSpec.of(g, [meta[n].dtype for n in g], [meta[n].shape for n in g]) for g in source.groups()])
        n = len(self.header.groups)
        self.buffers: list[torch.Tensor | None] = [None] * n
        self.digests: list[bytes | None] = [None] * n
        self.digest: str | None = None
        """The version digest (hex), once filled."""
        self.error: BaseException | None = None
        self.fill_seconds = 0.0
        self._spare = reuse.buffers if reuse is not None and reuse.idle() else [None] * n
        self._cond = threading.Condition()
        self._users = 0

    def fill(self) -> str:
        """Pack and hash every group (iterates the source: a collective on every trainer
        rank); returns the version digest. Readers see each group as it lands."""
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstream-hash") as hasher:
                hashed = []
                for g, (names, tensors) in enumerate(self.source.iter_groups()):
                    buf = wire.pack(tensors, out=self._spare[g])
                    self._set(self.buffers, g, buf)
                    hashed.append(hasher.submit(self._hash, g, buf))
                for f in hashed:
                    f.result()
            digest = wire.version_digest(self.digests).hex()
        except BaseException as e:
            with self._cond:
                self.error = e
                self._cond.notify_all()
            raise
        with self._cond:
            self.digest, self._spare = digest, []
            self.fill_seconds = time.perf_counter() - t0
            self._cond.notify_all()
        return digest

    def _hash(self, g: int, buf: torch.Tensor) -> None:
        self._set(self.digests, g, wire.digest(buf))

    def _set(self, slots: list, g: int, value) -> None:
        with self._cond:
            slots[g] = value
            self._cond.notify_all()

    def _get(self, slots: list, g: int, timeout_s: float):
        with self._cond:
            if not self._cond.wait_for(lambda: slots[g] is not None or self.error is not None, timeout_s):
                raise WeightTransferError(f"version {self.version}: group {g} not packed within {timeout_s:.0f} s")
            if self.error is not None:
                raise WeightTransferError(f"version {self.version} could not be exported: {self.error}")
            return slots[g]

    def groups(self, timeout_s: float = 600.0) -> Iterator[tuple[torch.Tensor, Any]]:
        """(buffer, digest getter) per group, as `send_version` wants them; blocks for each."""
        for g in range(len(self.header.groups)):
            yield self._get(self.buffers, g, timeout_s), (lambda g=g: self._get(self.digests, g, timeout_s))

    def wait(self, timeout_s: float = 600.0) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: self.digest is not None or self.error is not None, timeout_s):
                raise WeightTransferError(f"version {self.version} not packed within {timeout_s:.0f} s")
            if self.error is not None:
                raise WeightTransferError(f"version {self.version} could not be exported: {self.error}")
            return self.digest

    def tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor (views of the buffers) of the filled version."""
        self.wait()
        return {n: t for spec, buf in zip(self.header.groups, self.buffers) for n, t in wire.unpack(buf, spec)}

    # readers hold the snapshot while they read it, so its buffers are reused only once idle
    def acquire(self) -> "Snapshot":
        with self._cond:
            self._users += 1
        return self

    def release(self) -> None:
        with self._cond:
            self._users -= 1

    def idle(self) -> bool:
        with self._cond:
            return self._users == 0 and self.digest is not None


class SnapshotSource(WeightSource):
    """A filled snapshot as a vLLM WeightSource (vLLM's nccl trainer engine), each tensor
    copied to `device` as it is sent."""

    def __init__(self, snapshot: Snapshot, device: str = "cuda"):
        self.snapshot, self.device = snapshot, device

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, getattr(torch, d), tuple(s)) for g in self.snapshot.header.groups
                for n, d, s in zip(g.names, g.dtypes, g.shapes)]

    def __iter__(self):
        for name, t in self.snapshot.tensors().items():
            yield name, t.to(self.device, non_blocking=True)


# ---------------------------------------------------------------- the control channel


class LinkClient:
    """vLLM's `VLLMWeightSyncClient` over one link's command channel (common/weights/link.py):
    each call posts a command the producer runs between its engine steps (producer/link.py)
    and waits for its answer, at most `timeout_s`."""

    def __init__(self, store, link: int, timeout_s: float):
        self.store, self.link, self.timeout_s = store, link, timeout_s
        self.channel = Channel(store, link)
        self.version: int | None = None
        """The version being sent (the producer serves it after an nccl update)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.channel.call("init", self.timeout_s, init_info=init_info)

    def start_weight_update(self) -> None:
        self.channel.call("start", self.timeout_s, version=self.version)

    def update_weights(self, update_info) -> None:
        self.channel.call("update", self.timeout_s, update_info=update_info, version=self.version)

    def finish_weight_update(self, weight_version: str | None = None) -> dict:
        return self.channel.call("finish", self.timeout_s, version=self.version)


# ---------------------------------------------------------------- the gloo engine


@dataclass
class RlstreamGlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    host: str
    """The endpoint's address as the producer dials it."""
    port: int
    link: int
    timeout_s: float = 30.0


class RlstreamGlooTrainerEngine(TrainerWeightTransferEngine[RlstreamGlooTrainerInitInfo]):
    init_info_cls = RlstreamGlooTrainerInitInfo

    def __init__(self, *, client: LinkClient, source=None, is_sender: bool = True):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.pair: GlooPair | None = None
        self.last: dict[str, float] = {}

    @classmethod
    def trainer_init(cls, init_info: RlstreamGlooTrainerInitInfo, *, client: LinkClient, source=None):
        """Join the link's gloo pair as rank 0 while the producer joins as rank 1 (its init
        command runs on a side thread, as vLLM's NCCL engine does)."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        worker = {"host": init_info.host, "port": init_info.port, "link": init_info.link,
                  "timeout_s": init_info.timeout_s}
        # a store connection of the pair's own: the channel's blocking waits hold theirs
        engine._store = open_store(init_info.host, init_info.port, init_info.timeout_s)
        with ThreadPoolExecutor(max_workers=1) as exe:
            joined = exe.submit(client.init_weight_transfer_engine, worker)
            try:
                engine.pair = GlooPair.open(engine._store, init_info.link, 0, init_info.timeout_s)
            finally:
                joined.result()
        return engine

    def send_weights(self) -> None:
        """Send `self.source` (a Snapshot) over the link: the producer starts receiving, the
        stream, then the producer confirms it has the whole version, verified."""
        snap: Snapshot = self.source
        self.client.version = snap.version
        t0 = time.perf_counter()
        self.client.start_weight_update()
        t1 = time.perf_counter()
        send_version(self.pair, snap.header, snap.groups())
        t2 = time.perf_counter()
        ack = self.client.finish_weight_update(str(snap.version))
        if ack.get("digest") != snap.digest:
            raise WeightTransferError(f"link {self.client.link}: the producer received digest "
                                      f"{str(ack.get('digest'))[:12]}, sent {str(snap.digest)[:12]}")
        self.last = {"start_s": t1 - t0, "stream_s": t2 - t1, "finish_s": time.perf_counter() - t2,
                     "total_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None


def open_nccl_link(client: LinkClient, host: str, source: SnapshotSource):
    """vLLM's own NCCL trainer engine on a link (GPU): a 2-rank NCCL group of its own, on
    a free port of this host; the producer joins through its init command.
    Never run: it needs a GPU and no test exercises it yet (docs/weights.md, "GPU")."""
    import socket

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=2, rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
