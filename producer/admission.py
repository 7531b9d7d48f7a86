"""Admission: may the producer start one more group now? (staleness backpressure)

The rule is a pure function over a small frozen snapshot, `AdmissionView`, so
unit tests call the real thing without Kafka or vLLM. `admission_block(view)`
returns why a new group must wait, or None to admit it. The reasons, checked
in this order (the service counts each but `in_flight` in
`rlstream_producer_held_back_total{reason}`):

- `paused`: the control topic says so;
- `publish_buffer`: finished samples are waiting for room in the publisher's
  bounded buffer (nothing is dropped; admission stays closed until they fit);
- `in_flight`: `producer.max_groups_in_flight` groups are generating;
- `staleness`: a group admitted now would be trained more than
  `max_staleness` versions after its dispatch version.

The staleness estimate. With the trainer at version V (its last
`TrainerProgress`), this producer's engine at version v, B groups per global
step (from `TrainerProgress` too: a producer never reads the consumer's
config) and Q groups queued ahead of a new one (`queued_groups`), the new
group is trained at about V + floor(Q / B); it is admitted iff
V + floor(Q / B) - v <= max_staleness. `max_staleness = 0` makes the pipeline
synchronous (one batch per version).

Dynamic sampling. When the trainer filters a share f of its groups for equal
rewards (`TrainerProgress.filtered_share`, consumer/stream/gate.py), a global step
takes about B / (1 - f) queued groups, so the new group is trained at about
V + floor(Q (1 - f) / B) (`steps_ahead`): producers admit that much more, and
filtering does not starve the trainer. f is capped at `MAX_FILTERED_SHARE`:
the share is an estimate over recent groups, and the cap bounds the queue
(at 10x the unfiltered one) for when it falls while the queue is long.

Q counts, in groups of G, the records on the rollouts topic the trainer has
not read (per partition: end offset - read offset), the records it read and
holds unfinished (partial groups, groups waiting for a batch), this
producer's records not yet acknowledged; plus this producer's groups still
generating. It deliberately ignores the trainer's checkpointed offsets: one
held group pins them while every record behind it is read and dropped, and
counting from there once stalled the 10-minute soak (docs/producer.md).

The end offsets are the one input that needs the broker: `TopicEnds` asks for
them (at most every 0.2 s) and is only called once the cheap reasons passed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rlstream.common.control.messages import TrainerProgress
from rlstream.common.kafka.client import end_offsets, make_consumer

log = logging.getLogger("rlstream.producer")

MAX_FILTERED_SHARE = 0.9
"""The largest filtered share the queue estimate trusts (see the module docstring)."""


def queued_groups(ends: Mapping[int, int], read_offsets: Mapping[int, int], held_records: int,
                  own_unacked_records: int, own_in_flight_groups: int, G: int) -> int:
    """Groups ahead of a new one: records on the topic the trainer has not read
    (per partition, end - read offset) plus the records it holds unfinished
    plus our own not yet acknowledged, in groups of G, plus our groups still
    generating."""
    records = held_records + own_unacked_records
    records += sum(max(0, end - read_offsets.get(p, 0)) for p, end in ends.items())
    return records // G + own_in_flight_groups


def steps_ahead(queued: int, groups_per_batch: int, filtered_share: float = 0.0) -> int:
    """Global steps before a group behind `queued` groups is trained: floor(Q (1 - f) / B)."""
    kept = queued * (1.0 - min(max(filtered_share, 0.0), MAX_FILTERED_SHARE))
    return int(kept / groups_per_batch + 1e-9)  # + 1e-9: 10 * (1 - 0.9) is 0.9999999999999998


@dataclass(frozen=True)
class AdmissionView:
    """What admission looks at, as the service sees it at one instant."""

    paused: bool
    """The control topic's `paused` setting."""
    pending_samples: int
    """Finished samples waiting for room in the publish buffer."""
    groups_in_flight: int
    """This producer's groups with samples still generating."""
    max_groups_in_flight: int
    """`producer.max_groups_in_flight`."""
    progress: TrainerProgress
    """The trainer's last TrainerProgress (trainer_version, read_offsets, held_records, groups_per_batch,
    filtered_share)."""
    engine_version: int
    """The policy version this producer's engine serves (the new group's dispatch version)."""
    max_staleness: int
    """The control topic's `max_staleness`."""
    end_offsets: Callable[[], Mapping[int, int]]
    """Rollouts topic end offsets per partition. Called only when the cheap reasons
    pass: it may ask the broker (tests pass `lambda: {...}`)."""
    own_unacked_records: int
    """This producer's records not yet acknowledged (pending + in the publisher's buffer)."""
    group_size: int
    """G, samples per group."""


def admission_block(view: AdmissionView) -> str | None:
    """Why a new group may not be admitted now (None: admit it)."""
    if view.paused:
        return "paused"
    if view.pending_samples:
        return "publish_buffer"
    if view.groups_in_flight >= view.max_groups_in_flight:
        return "in_flight"
    p = view.progress
    queued = queued_groups(view.end_offsets(), p.read_offsets, p.held_records, view.own_unacked_records,
                           view.groups_in_flight, view.group_size)
    if p.trainer_version + steps_ahead(queued, p.groups_per_batch, p.filtered_share) - view.engine_version\
            > view.max_staleness:
        return "staleness"
    return None


# ---------------------------------------------------------------------------
# the one input that needs the broker
# ---------------------------------------------------------------------------
class TopicEnds:
    """End offsets of the rollouts topic as this producer sees them.

    Queried at most every 0.2 s (common/kafka/client.py `end_offsets`, which
    documents tansu's under-count) and raised to just past this producer's own
    acknowledged records. `on_delivered` is the
    publisher's acknowledgement callback (it runs on the publisher's thread).
    """

    def __init__(self, kafka):
        self.kafka = kafka
        self._ends: dict[int, int] = {}  # as last queried
        self._ends_at = 0.0
        self._acked_end: dict[int, int] = {}  # partition -> 1 + offset of our newest acknowledged record
        self._offsets_client = self._make_offsets_client()

    def _make_offsets_client(self):
        from kafka import TopicPartition

        c = make_consumer(self.kafka)
        topic = self.kafka.topics.rollouts
        self._rollout_tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or {0})]
        return c

    def current(self) -> dict[int, int]:
        """Partition -> end offset (the last answer if the broker does not answer)."""
        now = time.monotonic()
        if now - self._ends_at > 0.2:
            self._ends_at = now
            try:  # short timeout: in a broker outage the loop must keep stepping the engine
                self._ends = end_offsets(self._offsets_client, self._rollout_tps, timeout_ms=250)
            except Exception as e:  # noqa: BLE001 - keep the last answer; our own records still count
                log.debug("end offsets unavailable (%s); using the last answer", e)
        return {tp.partition: max(self._ends.get(tp.partition, 0), self._acked_end.get(tp.partition, 0))
                for tp in self._rollout_tps}

    def on_delivered(self, fut) -> None:  # publisher thread
        if fut.cancelled() or fut.exception() is not None:
            return
        d = fut.result()
        if d.offset + 1 > self._acked_end.get(d.partition, 0):
            self._acked_end[d.partition] = d.offset + 1

    def close(self) -> None:
        self._offsets_client.close()
