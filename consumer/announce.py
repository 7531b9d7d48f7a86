"""What the consumer tells the producers on the policy topic
(common/control/messages.py): new weights (`WeightsReady`) and where the
trainer is (`TrainerProgress`).

Order per step: checkpoint, then announce. A crash between the two leaves a
checkpointed version unannounced; a restarted consumer announces its version
again when the policy topic is behind it (`catch_up`).

Progress feeds the producers' backpressure: they count the groups queued ahead
of a new one from the trainer's read offsets and held records
(docs/producer.md). Without updates while the trainer waits for data, records
the gate dropped (or DLQ'd, or timed out) would count as queued until the next
step, and a pipeline whose queue was all dropped would wait forever; so the
service announces progress during its reads too, at most every second and
only when something changed. Progress also carries the share of recent groups
that dynamic sampling filtered (consumer/staleness.py `FilteredShare`): the
producers admit that much more, so that filtering does not starve the trainer.
"""
from __future__ import annotations

import time

from common.control.messages import TrainerProgress, WeightsReady


class PolicyAnnouncer:
    def __init__(self, writer, store, model_path: str, groups_per_batch: int, group_size: int):
        self.writer, self.store, self.model_path = writer, store, model_path
        self.groups_per_batch, self.group_size = groups_per_batch, group_size
        self.sent: TrainerProgress | None = None
        """The last progress message sent."""
        self._at = 0.0

    def weights(self, version: int, tensors: dict) -> None:
        """Write `tensors` as weight `version` to the store, then announce them."""
        m = self.store.write(version, tensors, self.model_path)
        self.writer.announce(WeightsReady(version=version, uri=m["uri"], sha256=m["sha256"], bytes=m["bytes"]))

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

    @staticmethod
    def behind(announced: WeightsReady | None, version: int) -> bool:
        """Whether the policy topic's newest weights are older than `version` (a restart)."""
        return announced is None or announced.version < version
