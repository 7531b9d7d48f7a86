"""What the consumer tells the producers on the policy topic
(common/control/messages.py): new weights (`WeightsReady`) and where the
trainer is (`TrainerProgress`).

New weights, per `consumer.weights.transport` (docs/weights.md):
- collective: the version is packed into a snapshot that every producer link
  streams while it fills (consumer/weights/sender.py, consumer/weights/fanout.py), then
  announced with its digest, the endpoint, the backend and the newest durable
  copy; the durable store is written in the background every `durable_every`
  versions and at shutdown;
- file: the version is written to the durable store and announced (uri,
  sha256, bytes), every version.

Order per step: checkpoint, then announce. A crash between the two leaves a
checkpointed version unannounced; a restarted consumer announces its version
again when the policy topic is behind it, and always on the collective path
(its endpoint is new).

Progress feeds the producers' backpressure: they count the groups queued ahead
of a new one from the trainer's read offsets and held records
(docs/producer.md). Without updates while the trainer waits for data, records
the gate dropped (or DLQ'd, or timed out) would count as queued until the next
step, and a pipeline whose queue was all dropped would wait forever; so the
service announces progress during its reads too, at most every second and
only when something changed. Progress also carries the share of recent groups
that dynamic sampling filtered (consumer/stream/gate.py `FilteredShare`): the
producers admit that much more, so that filtering does not starve the trainer.
"""
from __future__ import annotations

import time

from rlstream.common.config import WeightSyncSettings
from rlstream.common.control.messages import TrainerProgress, WeightsReady
from rlstream.consumer import telemetry
from rlstream.consumer.weights.durable import DurableWriter


class PolicyAnnouncer:
    def __init__(self, writer, store, model_path: str, groups_per_batch: int, group_size: int,
                 weights: WeightSyncSettings | None = None, backend: str = "rlstream_gloo"):
        self.writer, self.store, self.model_path = writer, store, model_path
        self.groups_per_batch, self.group_size = groups_per_batch, group_size
        self.sent: TrainerProgress | None = None
        """The last progress message sent."""
        self._at = 0.0
        weights = weights or WeightSyncSettings()
        self.sender = self.durable = self.snapshot = None
        if weights.transport == "collective":
            from rlstream.consumer.weights.sender import WeightSender  # defers vLLM

            self.sender = WeightSender(weights, backend)
            self.durable = DurableWriter(store, model_path, weights.durable_every)

    def weights(self, version: int, source) -> None:
        """Publish `source` (the trainer's WeightSource, iterated once: a collective on
        every rank) as weight `version`, then announce it."""
        if self.sender is None:
            from rlstream.consumer.train.export import collect  # defers torch

            m = self.store.write(version, collect(source), self.model_path)
            self.writer.announce(WeightsReady(version=version, transport="file", uri=m["uri"], sha256=m["sha256"],
                                              bytes=m["bytes"]))
            return
        from rlstream.consumer.weights.snapshot import Snapshot  # defers torch

        snap = Snapshot(version, source, reuse=self.snapshot)
        self.sender.publish(snap)  # the links stream each group as it is packed
        snap.fill()
        telemetry.WEIGHT_EXPORT_SECONDS.observe(snap.fill_seconds)
        self.snapshot = snap
        self.durable.maybe_write(snap)
        self.writer.announce(self._ready(snap))

    def _ready(self, snap) -> WeightsReady:
        d = self.durable.newest
        durable = {} if d is None else dict(durable_version=d.version, durable_uri=d.uri,
                                            durable_sha256=d.sha256, durable_bytes=d.bytes)
        return WeightsReady(version=snap.version, transport="collective", digest=snap.digest,
                            endpoint=self.sender.endpoint, backend=self.sender.backend, **durable)

    def behind(self, announced: WeightsReady | None, version: int) -> bool:
        """Whether to publish at start: the policy topic's newest weights are older than
        `version` (a restart), or the path is collective (the endpoint is new)."""
        return self.sender is not None or announced is None or announced.version < version

    def progress(self, version: int, read_offsets: dict[int, int], held_records: int,
                 filtered_share: float = 0.0, every_s: float = 1.0) -> None:
        """Send the progress, at most every `every_s` seconds and only when it changed."""
        now = time.monotonic()
        if now - self._at < every_s:
            return
        self._at = now
        msg = TrainerProgress(trainer_version=version, read_offsets=dict(read_offsets),
                              held_records=held_records, groups_per_batch=self.groups_per_batch,
                              group_size=self.group_size, filtered_share=round(filtered_share, 3))
        sent = self.sent
        if sent is None or sent.model_dump(exclude={"created_at"}) != msg.model_dump(exclude={"created_at"}):
            self.writer.announce(msg)
            self.sent = msg

    def close(self) -> None:
        """Collective: make the last version durable and announce that copy (producers that
        start after the trainer stopped catch up from it), then close the links."""
        if self.sender is None:
            return
        try:
            before = self.durable.newest
            self.durable.flush(self.snapshot)
            if self.snapshot is not None and self.durable.newest != before:
                self.writer.announce(self._ready(self.snapshot))
        finally:
            self.sender.close()
            self.durable.close()
