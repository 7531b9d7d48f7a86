"""Reading a topic forward, raw, from chosen offsets: the tools' reader (replay, export, blob GC).

    scan = TopicScan(kafka, topic)               # every partition assigned, no group, nothing committed
    scan.seek({0: 120, 1: 98})                   # others stay where they are (the log start)
    msgs = scan.poll(only={0})                   # raw messages of the partitions in `only` (the rest paused)
    scan.end(0)                                  # where partition 0 ended when the scan first fetched it
    scan.done(0)                                 # its position reached that end

Unlike `RolloutReader` (the consumer's: decode, validate, DLQ), a scan hands
back raw messages and never writes anything: a tool decides what a bad record
means to it. The end of a partition is fixed the first time a fetch answers for
it (its high watermark then, or ListOffsets if higher: tansu's ListOffsets is
only a lower bound, common/kafka/client.py `end_offsets`), so a scan of a topic
that producers keep writing stops where the topic ended when it started
reading that partition.
"""
from __future__ import annotations

import time

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError, ConfigError
from rlstream.common.kafka.client import FETCH_OVERHEAD_BYTES, make_consumer


def require_broker(kafka: KafkaSettings, tool: str) -> None:
    """A tool reads the log a deployment wrote: an embedded broker started for it would be empty."""
    if not kafka.bootstrap_servers:
        raise ConfigError(f"rlstream {tool} reads an existing topic: set it to the broker that holds it",
                          key="kafka.bootstrap_servers")


class TopicScan:
    """Raw messages of one topic, read forward from explicit offsets."""

    def __init__(self, kafka: KafkaSettings, topic: str, fetch_max_wait_ms: int = 50,
                 fetch_max_bytes: int = 16 << 20, partition_fetch_bytes: int = 4 << 20):
        from kafka import TopicPartition

        self.kafka, self.topic = kafka, topic
        # small fetches bound what the client buffers (partitions x partition_fetch_bytes, at most
        # fetch_max_bytes a response), not the topic or kafka.max_message_bytes: a record batch
        # larger than them still comes, alone (KIP-74; a 3 MiB record through 1 MiB fetches on tansu 0.6)
        self._consumer = make_consumer(
            kafka, auto_offset_reset="earliest", fetch_max_bytes=fetch_max_bytes,
            max_partition_fetch_bytes=partition_fetch_bytes,
            receive_message_max_bytes=max(fetch_max_bytes, kafka.max_message_bytes) + FETCH_OVERHEAD_BYTES,
            fetch_max_wait_ms=fetch_max_wait_ms, check_crcs=True)
        parts = self._partitions(time.monotonic() + kafka.request_timeout_ms / 1000)
        self._tps = {p: TopicPartition(topic, p) for p in parts}
        self._consumer.assign(list(self._tps.values()))
        self._listed = self._list_ends()
        self._ends: dict[int, int] = {}

    def _partitions(self, deadline: float) -> list[int]:
        while not (parts := self._consumer.partitions_for_topic(self.topic)):
            if time.monotonic() > deadline:
                self._consumer.close()
                raise BrokerError(f"topic {self.topic} does not exist on {self.kafka.bootstrap_servers}")
            time.sleep(0.1)
        return sorted(parts)

    def _list_ends(self) -> dict[int, int]:
        try:
            answer = self._consumer.end_offsets(list(self._tps.values()), timeout_ms=self.kafka.request_timeout_ms)
        except Exception as e:
            raise BrokerError(f"ListOffsets on {self.topic} failed ({type(e).__name__}: {e})") from e
        return {tp.partition: int(o) for tp, o in answer.items()}

    @property
    def partitions(self) -> list[int]:
        return list(self._tps)

    def log_starts(self) -> dict[int, int]:
        """The first offset each partition still holds (earlier records were deleted by retention)."""
        try:
            answer = self._consumer.beginning_offsets(list(self._tps.values()),
                                                      timeout_ms=self.kafka.request_timeout_ms)
        except Exception as e:
            raise BrokerError(f"ListOffsets(earliest) on {self.topic} failed ({type(e).__name__}: {e})") from e
        return {tp.partition: int(o) for tp, o in answer.items()}

    def seek(self, offsets: dict[int, int]) -> None:
        for p, o in offsets.items():
            if p not in self._tps:
                raise BrokerError(f"topic {self.topic} has no partition {p} (it has {self.partitions})")
            self._consumer.seek(self._tps[p], int(o))

    def seek_to_start(self) -> None:
        self._consumer.seek_to_beginning(*self._tps.values())

    def position(self, p: int) -> int:
        return int(self._consumer.position(self._tps[p]))

    def poll(self, only: set[int] | None = None, timeout_s: float = 0.5, max_records: int = 2000) -> list:
        """Raw messages (kafka-python ConsumerRecords) of the partitions in `only` (None: all),
        in offset order per partition; the other partitions are paused meanwhile."""
        want = set(self._tps) if only is None else set(only)
        self._consumer.pause(*[tp for p, tp in self._tps.items() if p not in want])
        self._consumer.resume(*[tp for p, tp in self._tps.items() if p in want])
        raw = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        for p in want:
            if p not in self._ends and (hw := self._consumer.highwater(self._tps[p])) is not None:
                self._ends[p] = max(int(hw), self._listed.get(p, 0))
        return [m for msgs in raw.values() for m in msgs]

    def end(self, p: int) -> int | None:
        """Where partition `p` ended when a fetch first answered for it (None before: poll it)."""
        return self._ends.get(p)

    def done(self, p: int) -> bool:
        """`p` was read to its end (False until a fetch answered for it)."""
        end = self._ends.get(p)
        return end is not None and self.position(p) >= end

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> "TopicScan":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
