"""`LinkClient`: vLLM's `VLLMWeightSyncClient` over one link's command channel.

    client = LinkClient(store, link, timeout_s)
    client.version, client.fold = snap.version, lambda: snap.digest
    client.start_weight_update()      # posts `start` (with the version), waits for its ack

Each call posts a command the producer runs between its engine steps
(producer/weights/trainer_link.py) and waits for its answer, at most `timeout_s`
(common/weights/link.py `Channel`). The channel is the one control channel of a
version on both backends: `start` names it, `finish` carries the digest of what was
sent, and the producer answers the finish only once it serves that version.
"""
from __future__ import annotations

from typing import Any

from rlstream.common.weights.link import Channel


class LinkClient:
    def __init__(self, store, link: int, timeout_s: float):
        self.store, self.link, self.timeout_s = store, link, timeout_s
        self.channel = Channel(store, link)
        self.version: int | None = None
        """The version being sent."""
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
