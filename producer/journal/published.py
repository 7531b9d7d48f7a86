"""Was an orphaned episode's record already published? Look in the rollouts topic.

A producer can die after its record was acknowledged and before the journal tombstone
that says so was written (journal.py `on_delivered`): the journal still shows the
episode unfinished, and resuming it would publish it twice. Kafka transactions would
make the record and the tombstone one write, but tansu 0.6 shows aborted records to
read_committed readers (docs/kafka.md), so the resumer checks the topic instead.

It knows where to look. Every journal write carries `rollout_ends`, the rollouts
topic's end offsets as its writer last knew them (producer/admission.py `TopicEnds`: a
lower bound, ListOffsets raised to just past the producer's own acknowledged records).
The record is published after the episode's last write, so if it exists it lies at or
after those offsets. `published` reads each partition from the lowest such offset of
the rollout ids it is asked about to the partition's end: what every producer
published since the dead one's last turn, a few seconds of records.

Records are read as the consumer reads them (common/record/codec.py `decode_any`: a
claim-check pointer names its rollout id, the blob is not fetched); one that cannot be
decoded is skipped (the consumer sends it to the dead-letter topic). The read is bounded
in time: what it could not read is reported unknown, and the caller resumes those
(a copy the consumer then drops by rollout id, rather than a lost episode).
"""
from __future__ import annotations

import logging
import time

from rlstream.common.config import KafkaSettings
from rlstream.common.kafka.client import at_high_watermark, make_consumer
from rlstream.common.record import decode_any

log = logging.getLogger("rlstream.producer.journal")


def published(kafka: KafkaSettings, wanted: dict[str, dict[int, int]], deadline_s: float = 30.0) -> set[str]:
    """The rollout ids of `wanted` (id -> {partition: lower bound}) found in the rollouts topic."""
    from kafka import TopicPartition

    if not wanted:
        return set()
    topic = kafka.topics.rollouts
    consumer = make_consumer(kafka, auto_offset_reset="earliest",
                             max_partition_fetch_bytes=kafka.max_message_bytes + (1 << 20))
    found: set[str] = set()
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or {0})
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        for tp in tps:  # from the lowest bound any wanted record may lie at (0 where a bound is missing)
            consumer.seek(tp, min(ends.get(tp.partition, 0) for ends in wanted.values()))
        deadline = time.monotonic() + deadline_s
        left = set(tps)
        while left and time.monotonic() < deadline:
            for tp, messages in consumer.poll(timeout_ms=200, max_records=2000).items():
                for m in messages:
                    try:
                        rid = decode_any(m.value).rollout_id
                    except Exception:  # noqa: BLE001 - not a record: the consumer's dead-letter path owns it
                        continue
                    if rid in wanted:
                        found.add(rid)
            left = {tp for tp in left if not at_high_watermark(consumer, tp)}
            if len(found) == len(wanted):
                break
        if left and len(found) < len(wanted):
            log.warning("rollouts topic not read to its end within %.0f s (%s): %d episodes resumed without "
                        "knowing whether their record was published (a copy is dropped by rollout id)",
                        deadline_s, sorted(tp.partition for tp in left), len(wanted) - len(found))
    finally:
        consumer.close()
    return found

