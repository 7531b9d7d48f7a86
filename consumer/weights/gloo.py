"""The trainer half of `rlstream_gloo` (the producer half is producer/weights/worker/gloo_engine.py):
a vLLM weight-transfer trainer engine that streams a packed `Snapshot` over one link's
gloo pair, or down the fan-out group's chain, with a blake3 digest per group.

    backend = GlooTrainer()                                   # consumer/weights/backend.py chooses it
    engine = backend.open(client, host, port, snap, layout, timeout_s, link=n)   # or group=prefix
    backend.send(engine, snap, timeout_s)                     # start -> stream -> finish(digest)
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.backends import GLOO
from rlstream.common.weights.chain import ChainLink
from rlstream.common.weights.link import GlooPair, GroupLayout, open_store, send_version
from rlstream.consumer.weights.client import LinkClient
from rlstream.consumer.weights.snapshot import Snapshot


def register() -> None:
    """Register the trainer-side `rlstream_gloo` with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if GLOO not in WeightTransferTrainerFactory._registry:  # register_engine raises on a duplicate
        WeightTransferTrainerFactory.register_engine(GLOO, __name__, "RlstreamGlooTrainerEngine")


@dataclass
class RlstreamGlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = GLOO

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
            raise WeightTransferError(f"link {getattr(self.client, 'link', 'fan-out')}: the producer acknowledged "
                                      f"digest {str(ack.get('digest'))[:12]}, sent {str(snap.digest)[:12]}")
        self.last = {"start_s": t1 - t0, "stream_s": t2 - t1, "finish_s": time.perf_counter() - t2,
                     "total_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None


class GlooTrainer:
    """rlstream_gloo as the sender's backend (consumer/weights/backend.py)."""

    name = GLOO
    commit_early = False
    """Each member's finish waits for the whole group's stream (consumer/weights/fanout.py)."""

    def __init__(self):
        register()

    def open(self, client, host: str, port: int, snap: Snapshot, layout: GroupLayout, timeout_s: float,
             link: int = 0, group: str = "") -> RlstreamGlooTrainerEngine:
        """One link's gloo pair (`link`), or the fan-out group's chain (`group`, its prefix)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        info = RlstreamGlooTrainerInitInfo(host=host, port=port, link=link, layout=layout, timeout_s=timeout_s,
                                           rank=0, group=group)
        return WeightTransferTrainerFactory.trainer_init(info, client=client)

    def send(self, engine, snap: Snapshot, timeout_s: float) -> None:
        """Every op of the pair is bounded by its group timeout already."""
        engine.client.version = snap.version
        engine.client.fold = lambda: snap.digest  # the finish carries the version's digest
        engine.source = snap
        engine.send_weights()
