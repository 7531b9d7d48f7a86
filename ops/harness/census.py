"""Reading topics back, independently of every service's counters, and the record accounting.

- `read_topic`: every raw message of a topic (all partitions) until it has
  been quiet for a moment (or up to its end offsets at the call, `to_end`, for
  a topic running services keep busy); `read_dlq` and `read_rollouts` decode the DLQ's
  headers and the rollout records (tests and benchmarks).
- `topic_census`: the rollouts topic read from offset 0 to its end offsets:
  records, distinct rollout ids, end offsets (what the producers published),
  and what scored them (`reward_info` verifier, and dataset for reasoning-gym;
  how many rewards were partial credit, strictly between 0 and 1).
- `account`: the demo's conservation law,

      published = trained + dropped_stale + timed_out + duplicate + dlq + filtered + held

  from the census and the consumer's final counters (its run file's stop
  record: outcomes and held records at the moment it stopped).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rlstream.common.config import KafkaSettings
from rlstream.common.kafka.client import make_consumer
from rlstream.common.kafka.dlq import H_FIELD, H_REASON, H_SOURCE
from rlstream.common.record import Rollout, decode_any
from rlstream.consumer.stream.ledger import OUTCOMES


def _open(kafka: KafkaSettings, topic: str):
    """A group-less consumer assigned to every partition of `topic`, at offset 0."""
    from kafka import TopicPartition

    fetch = kafka.max_message_bytes + (1 << 20)
    c = make_consumer(kafka, auto_offset_reset="earliest", max_partition_fetch_bytes=fetch,
                      fetch_max_bytes=max(52_428_800, fetch))
    tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or {0})]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    return c, tps


# ---------------------------------------------------------------------------- raw reads

def read_topic(kafka: KafkaSettings, topic: str, quiet_s: float = 1.5, timeout_s: float = 60,
               to_end: bool = False) -> list:
    """Every raw message of `topic` (all partitions), until `quiet_s` without new ones.

    `to_end`: until the end offsets of the moment it starts instead (every record acknowledged
    before the call), for a topic that running services keep writing: it is never quiet then,
    and the read took its whole `timeout_s`. The end of a partition is its high watermark in
    the first fetch that answers for it: tansu's ListOffsets is only a lower bound
    (common/kafka/client.py end_offsets).
    """
    c, tps = _open(kafka, topic)
    try:
        listed = c.end_offsets(tps) if to_end else None  # 0: empty at the call, nothing to wait for
        ends = None
        out, last, deadline = [], time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if to_end:
                if ends is None and all(listed[tp] == 0 or c.highwater(tp) is not None for tp in tps):
                    ends = {tp: max(listed[tp], c.highwater(tp) or 0) for tp in tps}
                if ends is not None and all(c.position(tp) >= ends[tp] for tp in tps):
                    break
            elif time.monotonic() - last >= quiet_s:
                break
            for msgs in c.poll(timeout_ms=300, max_records=5000).values():
                out.extend(msgs)
                last = time.monotonic()
        return out
    finally:
        c.close()


@dataclass(frozen=True)
class DeadLetter:
    source: str
    """topic/partition/offset of the original record."""
    field: str
    reason: str
    value: bytes


def read_dlq(kafka: KafkaSettings, **kw) -> list[DeadLetter]:
    """Every message on the dead-letter topic, with its reason headers."""
    out = []
    for m in read_topic(kafka, kafka.topics.dlq, **kw):
        h = {k: v.decode("utf-8", "replace") for k, v in (m.headers or [])}
        out.append(DeadLetter(h.get(H_SOURCE, "?"), h.get(H_FIELD, "?"), h.get(H_REASON, "?"), m.value))
    return out


def read_rollouts(kafka: KafkaSettings, **kw) -> dict[str, object]:
    """rollout_id -> Rollout of every decodable record on the rollouts topic."""
    out = {}
    for m in read_topic(kafka, kafka.topics.rollouts, **kw):
        try:
            r = decode_any(m.value)
        except Exception:  # noqa: BLE001 - bad records are the DLQ's business
            continue
        if isinstance(r, Rollout):
            out[r.rollout_id] = r
    return out


# ---------------------------------------------------------------------------- census + accounting

@dataclass
class TopicCensus:
    end_offsets: int
    """Sum of the partitions' end offsets."""
    records: int
    """Records actually read from offset 0 to the end offsets."""
    distinct_ids: int
    """Distinct rollout ids among them (a producer retry could duplicate a record)."""
    scored_by: dict[str, int] = field(default_factory=dict)
    """Records per scorer: reward_info's `verifier` (":dataset" for reasoning-gym)."""
    partial_rewards: int = 0
    """Records whose reward is strictly between 0 and 1 (partial credit)."""


def topic_census(kafka: KafkaSettings, timeout_s: float = 60.0) -> TopicCensus:
    """Count what the producers published, independently of every service's counters."""
    import msgpack

    c, tps = _open(kafka, kafka.topics.rollouts)
    try:
        ends = c.end_offsets(tps)
        ids, records, scored_by, partial = set(), 0, Counter(), 0
        deadline = time.monotonic() + timeout_s
        while any(c.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for batch in c.poll(timeout_ms=500, max_records=10_000).values():
                for msg in batch:
                    records += 1
                    try:
                        m = msgpack.unpackb(msg.value, raw=False)
                        ids.add(m.get("rollout_id"))
                    except Exception:  # noqa: BLE001 - undecodable: counted, not identified
                        ids.add(("undecodable", msg.partition, msg.offset))
                        continue
                    scored_by[_scorer(m)] += 1
                    partial += isinstance(m.get("reward"), float) and 0.0 < m["reward"] < 1.0
        return TopicCensus(int(sum(ends.values())), records, len(ids), dict(scored_by), int(partial))
    finally:
        c.close()


def _scorer(m) -> str:
    info = m.get("reward_info") if isinstance(m, dict) else None
    if not isinstance(info, dict):
        return "?"
    return str(info.get("verifier", "?")) + (f":{info['dataset']}" if "dataset" in info else "")


def account(census: TopicCensus | None, outcomes: dict[str, float] | None, held: int | None,
            group_size: int, groups_per_batch: int) -> dict:
    """published == trained + dropped_stale + timed_out + duplicate + dlq + filtered + held.

    `held` are records the consumer had read but not given an outcome when it
    stopped (partial groups, complete groups waiting for a full batch); the
    checkpoint keeps their offsets, so a restarted consumer trains them. With
    the consumer's own count the equation is checked exactly; without it
    (`held` None), held is the remainder and must be whole groups, fewer than B.
    """
    out = {o: int((outcomes or {}).get(o, 0)) for o in OUTCOMES}
    published = census.records if census else None
    out["published"] = published
    if census is not None:
        out["topic_end_offsets"], out["distinct_ids"] = census.end_offsets, census.distinct_ids
        out["scored_by"], out["partial_rewards"] = census.scored_by, census.partial_rewards
    counted = sum(out[o] for o in OUTCOMES)
    if published is None or outcomes is None:
        out.update(held=None, ok=False, why="published count or consumer counters unavailable")
        return out
    if held is not None:
        out["held"] = held
        out["ok"] = published == counted + held
        out["why"] = "exact (the consumer's held records)"
    else:
        held = published - counted
        out["held"] = held
        out["ok"] = 0 <= held < group_size * groups_per_batch and held % group_size == 0
        out["why"] = f"held = remainder, must be whole groups < B*G = {group_size * groups_per_batch}"
    return out
