"""The trainer half of vLLM's own `nccl` weight-transfer engine (GPU; on CPU only over the
test stand-ins, common/gpu_standin/): vLLM's `NCCLWeightTransferEngine` on one producer's
link or on the fan-out group, fed a packed `Snapshot` one tensor at a time.

    backend = NcclTrainer()                                   # consumer/weights/backend.py chooses it
    engine = backend.open(client, host, port, snap, layout, timeout_s)
    backend.send(engine, snap, timeout_s)                     # one at a time, under a watchdog
"""
from __future__ import annotations

import threading

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.backends import NCCL
from rlstream.common.weights.digest import Fold
from rlstream.common.weights.link import GroupLayout
from rlstream.common.weights.watchdog import Watchdog, abort_nccl, nccl_async_error
from rlstream.consumer.weights.snapshot import Snapshot


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
        # fold each tensor on the device as it is sent; the finish command carries the
        # digest, the producer compares it with what it folded
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
    client.fold = getattr(source, "fold_digest", None)  # the finish carries the sent digest
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class NcclTrainer:
    """vLLM's nccl as the sender's backend (consumer/weights/backend.py)."""

    name = NCCL
    commit_early = True
    """Each member's finish goes as soon as its own update returned (consumer/weights/fanout.py)."""

    def open(self, client, host: str, port: int, snap: Snapshot, layout: GroupLayout, timeout_s: float,
             link: int = 0, group: str = ""):
        """An NCCL group on a free port of `host` (the endpoint's `port` only hosts the commands)."""
        snap.wait()
        return open_nccl_link(client, host, SnapshotSource(snap), layout)

    def send(self, engine, snap: Snapshot, timeout_s: float) -> None:
        """One transfer at a time (`NCCL_SENDS`), under a watchdog that aborts the communicator
        when no tensor goes out for `timeout_s`, or at once when NCCL reports a lost peer
        (common/weights/watchdog.py): a dead or hung producer then costs the others at most
        that bound, and this raises, so its caller drops the link or group."""
        engine.client.version = snap.version
        snap.wait()
        source = engine.source = SnapshotSource(snap)  # one upload to the device per version
        engine.client.fold = source.fold_digest  # the finish carries this version's fold
        with NCCL_SENDS, Watchdog(timeout_s, lambda: abort_nccl(engine.model_update_group),
                                  what=f"the nccl send of version {snap.version}",
                                  errored=lambda: nccl_async_error(engine.model_update_group)) as dog:
            source.beat = dog.beat
            engine.send_weights()
