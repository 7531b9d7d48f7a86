"""Finished records on their way to Kafka, in order, none dropped.

The publisher's buffer is bounded (`kafka.publish_buffer_records`).
`flush()` hands records to it while it has room and keeps the rest in
`pending`; while anything is pending the producer admits no new group
(admission reason `publish_buffer`), so a slow broker slows generation
instead of growing memory. `drain()` (shutdown) publishes everything,
blocking, and waits until the broker acknowledged every record.
"""
from __future__ import annotations

from collections.abc import Callable

from rlstream.common.record import Rollout
from rlstream.producer import telemetry


class Outbox:
    """`pending` records in front of `publisher`; `on_delivered(future)` is
    attached to every non-blocking hand-over (it runs on the publisher's thread)."""

    def __init__(self, publisher, on_delivered: Callable[[object], None]):
        self.publisher = publisher
        self.pending: list[Rollout] = []
        self._on_delivered = on_delivered

    def add(self, record: Rollout) -> None:
        self.pending.append(record)

    @property
    def unacked_records(self) -> int:
        """Ours, not yet acknowledged by the broker: pending plus in the publisher's buffer."""
        return len(self.pending) + self.publisher.buffer_depth

    def flush(self) -> None:
        """Hand pending records to the publisher until its buffer is full."""
        while self.pending:
            fut = self.publisher.try_publish(self.pending[0])
            if fut is None:
                break  # buffer full: keep it, admission stays closed
            fut.add_done_callback(self._on_delivered)
            self.pending.pop(0)
        telemetry.PENDING.set(len(self.pending))

    def drain(self, timeout_s: float = 60) -> None:
        """Publish every pending record (blocking), then wait for every acknowledgement."""
        while self.pending:
            self.publisher.publish(self.pending.pop(0), timeout=timeout_s)
        self.publisher.flush(timeout=timeout_s)
