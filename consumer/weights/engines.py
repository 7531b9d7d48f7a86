"""The sending half of the collective weight path, on vLLM 0.32's weight-transfer framework.

    snap = Snapshot(version, source)            # source: a vLLM WeightSource (consumer/weights/export.py)
    sender.publish(snap)                        # link threads start streaming what is packed
    snap.fill()                                 # pack + hash group by group (collective on every rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LinkClient(...))   # per link
    engine.source = snap; engine.send_weights() # start -> stream -> finish (producer verified it)

`Snapshot` (consumer/weights/snapshot.py) is one version packed for sending; this
module streams it.

`RlstreamGlooTrainerEngine` (`rlstream_gloo`, the trainer half of
producer/weights/gloo_engine.py) streams a snapshot over one link's gloo pair; on GPU the
same link code drives vLLM's `nccl` trainer engine with the snapshot as its
source (`SnapshotSource`, groups copied to the device one tensor at a time).
`LinkClient` is vLLM's `VLLMWeightSyncClient` over the link's command channel.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource)

from common.errors import WeightTransferError
from common.weights.backends import GLOO
from common.weights.chain import ChainLink
from common.weights.digest import Fold
from common.weights.link import Channel, GlooPair, GroupLayout, open_store, send_version
from common.weights.watchdog import Watchdog, abort_nccl, nccl_async_error
from consumer.weights.snapshot import Snapshot
from consumer.weights.export import MegatronSource

BACKEND = GLOO
WeightSource.register(MegatronSource)  # implements the interface without importing vLLM


def register() -> None:
    """Register the trainer-side `rlstream_gloo` with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:  # register_engine raises on a duplicate
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "RlstreamGlooTrainerEngine")


# ---------------------------------------------------------------- the packed version


class SnapshotSource(WeightSource):
    """A filled snapshot as a vLLM WeightSource (vLLM's nccl trainer engine), each tensor
    copied to `device` as it is sent."""

    def __init__(self, snapshot: Snapshot, device: str | None = None):
        self.snapshot, self.device = snapshot, device or transfer_device()
        self.beat = lambda: None
        """Called as each tensor goes out (the trainer's watchdog, `send`)."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, getattr(torch, d), tuple(s)) for g in self.snapshot.header.groups
                for n, d, s in zip(g.names, g.dtypes, g.shapes)]

    def __iter__(self):
        # restore branch hook (issue 23, N5): fold each tensor on the device as it is sent; the
        # finish command carries the digest, the producer compares it with what it folded
        self.fold = Fold()
        for name, t in self.snapshot.tensors().items():
            self.beat()
            t = t.to(self.device, non_blocking=True)
            self.fold.add(name, t)
            yield name, t

    def fold_digest(self) -> str:
        return self.fold.hexdigest()


def transfer_device() -> torch.device:
    """The device vLLM's nccl trainer engine binds its communicator to (its
    `torch.accelerator.current_device_index()`): the tensors it sends must be there."""
    index = torch.accelerator.current_device_index()
    return torch.device(f"cuda:{index}" if isinstance(index, int) else index)


NCCL_SENDS = threading.Lock()
"""One nccl transfer at a time on the trainer. vLLM's packed broadcasts run on two CUDA
streams cached per process (packed_tensor.py `_get_streams`), shared by every sender: a
transfer stuck on them (a dead producer: NCCL never returns) would hold every later one
behind it. Taken before the producers are told to start receiving, so nobody waits in a
receive for its turn."""


def send(engine, snap: Snapshot, backend: str, timeout_s: float) -> None:
    """Send `snap` over a link's or the fan-out group's trainer engine. nccl: one transfer at
    a time (`NCCL_SENDS`), under a watchdog that aborts the communicator when no tensor goes
    out for `timeout_s`, or at once when NCCL reports a lost peer (common/weights/watchdog.py):
    a dead or hung producer then costs the others at most that bound, and this raises, so its
    caller drops the link or group.
    gloo: every op of the link is bounded by its group timeout already."""
    engine.client.version = snap.version
    if backend != "nccl":
        engine.client.fold = lambda: snap.digest  # the finish carries the version's digest
        engine.source = snap
        engine.send_weights()
        return
    snap.wait()
    source = engine.source = SnapshotSource(snap)  # one upload to the device per version
    engine.client.fold = source.fold_digest  # the finish carries this version's fold
    with NCCL_SENDS, Watchdog(timeout_s, lambda: abort_nccl(engine.model_update_group),
                              what=f"the nccl send of version {snap.version}",
                              errored=lambda: nccl_async_error(engine.model_update_group)) as dog:
        source.beat = dog.beat
        engine.send_weights()


# ---------------------------------------------------------------- the control channel


class LinkClient:
    """vLLM's `VLLMWeightSyncClient` over one link's command channel (common/weights/link.py):
    each call posts a command the producer runs between its engine steps (producer/weights/trainer_link.py)
    and waits for its answer, at most `timeout_s`."""

    def __init__(self, store, link: int, timeout_s: float):
        self.store, self.link, self.timeout_s = store, link, timeout_s
        self.channel = Channel(store, link)
        self.version: int | None = None
        """The version being sent (the producer serves it after an nccl update)."""
        self.fold = None
        """The digest of what was sent, carried by finish: the producer serves the version only if
        it received the same (nccl: `SnapshotSource.fold_digest`; gloo: the snapshot's digest)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.channel.call("init", self.timeout_s, init_info=init_info)

    def start_weight_update(self) -> None:
        self.channel.call("start", self.timeout_s, version=self.version)

    def update_weights(self, update_info) -> None:
        self.channel.call("update", self.timeout_s, update_info=update_info, version=self.version)

    def finish_weight_update(self, weight_version: str | None = None) -> dict:
        digest = {"digest": self.fold()} if self.fold is not None else {}
        return self.channel.call("finish", self.timeout_s, version=self.version, **digest)


# ---------------------------------------------------------------- the gloo engine


@dataclass
class RlstreamGlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    host: str
    """The endpoint's address as the producer dials it."""
    port: int
    link: int
    layout: GroupLayout = GroupLayout(2, (1,))
    """The link's group, from the producer's registration (common/weights/link.py `group_layout`)."""
    timeout_s: float = 30.0
    group: str = ""
    """A fan-out group's prefix (common/weights/chain.py `group_prefix`): the bytes go down a
    chain (ChainLink) over every member's workers; empty: one producer's link (GlooPair)."""


class RlstreamGlooTrainerEngine(TrainerWeightTransferEngine[RlstreamGlooTrainerInitInfo]):
    init_info_cls = RlstreamGlooTrainerInitInfo

    def __init__(self, *, client: LinkClient, source=None, is_sender: bool = True):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.pair: GlooPair | None = None
        self.last: dict[str, float] = {}

    @classmethod
    def trainer_init(cls, init_info: RlstreamGlooTrainerInitInfo, *, client: LinkClient, source=None):
        """Join the link's gloo group as rank 0 while the producer's workers join from its
        rank offset (its init command runs on a side thread, as vLLM's NCCL engine does)."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        layout = init_info.layout
        # a fan-out client (consumer/weights/fanout.py) puts each member's own offset and link in
        worker = {"host": init_info.host, "port": init_info.port, "link": init_info.link,
                  "timeout_s": init_info.timeout_s, "world_size": layout.world_size,
                  "rank_offset": layout.rank_offsets[0], "group": init_info.group}
        # a store connection of the pair's own: the channel's blocking waits hold theirs
        engine._store = open_store(init_info.host, init_info.port, init_info.timeout_s)
        with ThreadPoolExecutor(max_workers=1) as exe:
            joined = exe.submit(client.init_weight_transfer_engine, worker)
            try:
                if init_info.group:
                    engine.pair = ChainLink.open(engine._store, init_info.group, 0, layout.world_size,
                                                 init_info.timeout_s)
                else:
                    engine.pair = GlooPair.open(engine._store, init_info.link, 0, init_info.timeout_s,
                                                world_size=layout.world_size)
            finally:
                joined.result()
        return engine

    def send_weights(self) -> None:
        """Send `self.source` (a Snapshot) over the link: the producer starts receiving, the
        stream, then the finish with its digest, answered once the producer serves the version."""
        snap: Snapshot = self.source
        self.client.version = snap.version
        t0 = time.perf_counter()
        self.client.start_weight_update()
        t1 = time.perf_counter()
        send_version(self.pair, snap.header, snap.groups())
        t2 = time.perf_counter()
        ack = self.client.finish_weight_update(str(snap.version))
        if ack.get("digest") != snap.digest:
            raise WeightTransferError(f"link {getattr(self.client, 'link', 'fan-out')}: the producer received digest "
                                      f"{str(ack.get('digest'))[:12]}, sent {str(snap.digest)[:12]}")
        self.last = {"start_s": t1 - t0, "stream_s": t2 - t1, "finish_s": time.perf_counter() - t2,
                     "total_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None


def open_nccl_link(client, host: str, source: SnapshotSource, layout: GroupLayout):
    """vLLM's own NCCL trainer engine (GPU) on one producer's link or on the fan-out group:
    an NCCL group of `layout.world_size` ranks (1 + every member's workers, from their
    registrations), on a free port of this host; the workers join through their init
    commands. vLLM's engine and not a relay of ours: NCCL pipelines its broadcast (ring or
    tree, chunked), so the trainer sends each byte once for any number of producers, and
    its packed double buffers bound the trainer's GPU memory per version.
    Not run on a GPU yet: the group's sizing is tested on CPU against vLLM's own worker
    rank code (tests/unit/common/test_weight_groups.py; docs/weights.md, "GPU")."""
    import socket

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    # vLLM's trainer engine hands its workers rank_offset=1: right for one producer; a group of
    # several needs the fan-out client, which gives each member its own offset
    if layout.rank_offsets != (1,) and getattr(client, "layout", None) != layout:
        raise WeightTransferError(f"vLLM's nccl engine gives every worker rank offset 1; a group at offsets "
                                  f"{layout.rank_offsets} needs consumer/weights/fanout.py FanoutClient")
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=layout.world_size, rank=0)
    client.fold = getattr(source, "fold_digest", None)  # restore branch hook (N5): finish carries the sent digest
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def open_fanout_engine(sender, client, snap: Snapshot, layout: GroupLayout, prefix: str):
    """The trainer engine of one epoch of the fan-out group (consumer/weights/fanout.py):
    vLLM's nccl over the whole group on GPU, the gloo chain on CPU."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if sender.backend == "nccl":
        snap.wait()
        return open_nccl_link(client, sender.host, SnapshotSource(snap), layout)
    info = RlstreamGlooTrainerInitInfo(host=sender.host, port=sender.store.port, link=0, layout=layout,
                                       timeout_s=sender.settings.timeout_s, rank=0, group=prefix)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)
