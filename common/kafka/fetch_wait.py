"""A consumer's fetch wait, raised when the broker answers fetches with nothing while records wait.

The embedded broker (tansu, memory storage) spends a fetch's `max_wait` on
reading the log, not only on waiting for records: to serve a partition from an
offset below its high watermark it lists every record batch the partition holds
(one stored object per produce request, from the first offset up) and stops
listing when the fetch's wait has run out; batches it did not reach are not
returned. The listing time grows with the partition's length (measured on the
2-core machine: about 1 us per batch, ~20 ms at 20,000 batches), so once a
partition holds more batches than the wait can list, every fetch from a
position below its end comes back empty while its high watermark says records
are there: a consumer with a 20 ms wait read nothing for minutes after about
two hours of a pipeline's traffic, while a 100 ms fetch returned all of it.
Apache Kafka answers as soon as `fetch_min_bytes` is there and never does this.

`FetchWait` keeps the wait one consumer uses: it starts at `floor_ms` (short:
on tansu a fetch at the end of the log sleeps about half its wait before new
records are seen, which every global step of a synchronous pipeline pays) and
doubles, up to `cap_ms`, each time a poll returns no record although the high
watermark of the last fetch response is past the consumer's position for some
partition (`starved`). It never comes down: tansu's logs only grow, and on
Kafka it never rises. The owner then rebuilds its consumer with the new wait
(kafka-python reads `fetch_max_wait_ms` from its private configuration only;
a new consumer at the same positions is the public way, and it happens a few
times in a process's life at most: log2(cap / floor)). A new consumer has no
high watermark until its first fetch answers, so one empty fetch raises the
wait once.

Each raise is logged and counted (`rlstream_fetch_wait_raised_total{consumer}`),
and `rlstream_fetch_wait_seconds{consumer}` is the wait in use. At the cap the
fetches may still come back empty (a log too long to list in `cap_ms`): the
consumer's readiness says so (consumer/stream/intake.py `IntakeWatch`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from rlstream.common import metrics

log = logging.getLogger("rlstream.kafka")

FETCH_WAIT_CAP_MS = 5_000
"""The most a fetch waits: about 5 million batches of one partition on tansu; a fetch at the end of
the log then adds up to ~2.5 s to a step (kafka-python requires it below request_timeout_ms)."""

_WAIT = metrics.gauge("rlstream_fetch_wait_seconds", "Fetch wait (fetch_max_wait_ms, in seconds) a consumer uses "
                      "now: raised when fetches return nothing while records wait (common/kafka/fetch_wait.py)",
                      ["consumer"])
_RAISED = metrics.counter("rlstream_fetch_wait_raised_total",
                          "Times a consumer doubled its fetch wait because a fetch returned nothing while its "
                          "partitions' high watermark was past its position", ["consumer"])


class FetchWait:
    """The fetch wait of one consumer (`name`: what it reads, the metrics label: rollouts, control), between
    `floor_ms` and `cap_ms`."""

    def __init__(self, name: str, floor_ms: int, cap_ms: int = FETCH_WAIT_CAP_MS, request_timeout_ms: int = 30_000):
        cap_ms = max(floor_ms, min(cap_ms, request_timeout_ms // 2))
        self.name, self.floor_ms, self.cap_ms, self.ms = name, floor_ms, cap_ms, floor_ms
        self.raised = 0
        _WAIT.labels(consumer=name).set(self.ms / 1000)

    @property
    def at_cap(self) -> bool:
        return self.ms >= self.cap_ms

    def starved(self, consumer, raw: Mapping, positions: Mapping) -> list:
        """The partitions (TopicPartitions of `positions`) whose last fetch response reported
        records past `positions` (the next offsets to read), after a poll that returned `raw`
        with no record at all; [] otherwise."""
        if any(raw.values()):
            return []
        out = []
        for tp, position in positions.items():
            hw = consumer.highwater(tp)
            if hw is not None and hw > position:
                out.append(tp)
        return out

    def raise_for(self, starved: Iterable, positions: Mapping) -> bool:
        """Double the wait (up to the cap) for `starved` partitions; True if it changed (the
        owner then rebuilds its consumer with `ms`)."""
        starved = list(starved)
        if not starved or self.at_cap:
            return False
        before, self.ms = self.ms, min(2 * self.ms, self.cap_ms)
        self.raised += 1
        _WAIT.labels(consumer=self.name).set(self.ms / 1000)
        _RAISED.labels(consumer=self.name).inc()
        where = ", ".join(f"{tp.topic}/{tp.partition} at {positions[tp]}" for tp in starved[:4])
        log.warning("%s: a fetch with a %d ms wait returned nothing while records wait (%s%s); the broker "
                    "did not reach them in time (tansu lists a partition's whole log per fetch): fetch wait "
                    "now %d ms (at most %d)", self.name, before, where, ", ..." if len(starved) > 4 else "",
                    self.ms, self.cap_ms)
        return True
