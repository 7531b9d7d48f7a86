"""The sender's weight-transfer backend, chosen once from its name (common/weights/backends.py):

    backend = trainer_backend("rlstream_gloo")      # GlooTrainer (CPU) | NcclTrainer (vLLM's, GPU)
    engine = backend.open(client, host, port, snap, layout, timeout_s, link=n)   # a link; group=prefix: the fan-out
    backend.send(engine, snap, timeout_s)           # start -> stream -> finish(digest)

Everything the sender (consumer/weights/sender.py) and the fan-out group
(consumer/weights/fanout.py) do differently per backend is behind these two calls and
`commit_early`; a third backend is one more class here.
"""
from __future__ import annotations

from typing import Protocol

from vllm.distributed.weight_transfer.base import WeightSource

from rlstream.common.weights.backends import GLOO, NCCL
from rlstream.common.weights.link import GroupLayout
from rlstream.consumer.train.export import MegatronSource
from rlstream.consumer.weights.gloo import GlooTrainer
from rlstream.consumer.weights.nccl import NcclTrainer
from rlstream.consumer.weights.snapshot import Snapshot

WeightSource.register(MegatronSource)  # implements the interface without importing vLLM


class TrainerBackend(Protocol):
    name: str
    commit_early: bool
    """A fan-out member's finish goes with its own update (nccl), not after the whole group's (gloo)."""

    def open(self, client, host: str, port: int, snap: Snapshot, layout: GroupLayout, timeout_s: float,
             link: int = 0, group: str = ""): ...

    def send(self, engine, snap: Snapshot, timeout_s: float) -> None: ...


def trainer_backend(name: str) -> TrainerBackend:
    if name == GLOO:
        return GlooTrainer()
    if name == NCCL:
        return NcclTrainer()
    raise ValueError(f"weight-transfer backend {name!r}: use one of {GLOO}, {NCCL}")
