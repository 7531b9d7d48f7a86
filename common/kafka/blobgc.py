"""Garbage collection of the claim-check blob store (docs/log.md, "Retention").

    rlstream blobs gc -c deploy.yaml                       # delete blobs no retained record points to
    rlstream blobs gc -c deploy.yaml --report-only         # say what it would delete
    rlstream blobs gc -c deploy.yaml --keep-from-checkpoints runs/checkpoints

(the command: ops/blobs.py; `collect` here does the work)

A blob is deleted only if no record that must stay readable points to it and
it is older than `--min-age-s`:

- Retained records. Every record the rollouts topic and the DLQ (a dead
  letter keeps its original bytes: a pointer among them) still hold is read,
  and the digest of each claim-check pointer kept (`--topic` adds topics that
  share the store). Kafka's retention deletes records, never this collector;
  a blob outlives the last record pointing to it by one collection.
- Checkpoints. With `--keep-from-checkpoints DIR` (a consumer's
  checkpoint_dir; repeatable) only the rollouts records at or above the
  offsets of the oldest checkpoint kept in each DIR count: below them every
  listed consumer is done with its records (consumer/stream/ledger.py), and a replay
  from any kept checkpoint reads only records at or above its offsets. Those
  records keep their pointers on the topic but lose their blobs: a replay
  from an earlier step or an export of them then fails or rejects them,
  naming the record. Without the option nothing a retained record points to
  is deleted.
- Age. A producer stores a blob before the broker acknowledges its pointer,
  and retries the publish for as long as an outage lasts, so a blob younger
  than `--min-age-s` (default one day) is kept whatever the topics say; a
  `put` of bytes already stored (a retry) makes the blob young again. The
  blobs are listed before the topics are read, so a blob stored during the
  collection is never a candidate.

Temporary files a crashed `put` left behind go once older than the same age.
Run it on a schedule (a cron job or systemd timer; docs/operations.md); each
run reads the retained part of the topics once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgpack

from rlstream.common.config import KafkaSettings
from rlstream.common.kafka.claimcheck import BlobFile, BlobStore
from rlstream.common.kafka.scan import TopicScan

log = logging.getLogger("rlstream.blobs")

POINTER_MAX_BYTES = 16 << 10
"""A value longer than this is a record, not a claim-check pointer (~250 bytes), and is not decoded."""


@dataclass
class GcReport:
    blobs: int = 0
    referenced: int = 0
    """Distinct digests the records read point to."""
    kept_referenced: int = 0
    kept_young: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    temporaries_deleted: int = 0
    dry_run: bool = False


def pointer_digest(value: bytes | None) -> str | None:
    """The sha256 a message value's claim-check pointer names (None: not a pointer)."""
    if value is None or len(value) > POINTER_MAX_BYTES:
        return None
    try:
        m = msgpack.unpackb(value, raw=False)
    except Exception:  # noqa: BLE001 - undecodable bytes (a dead letter) point to nothing
        return None
    cc = m.get("claim_check") if isinstance(m, dict) else None
    sha = cc.get("sha256") if isinstance(cc, dict) else None
    return sha if isinstance(sha, str) and len(sha) == 64 else None


def referenced(kafka: KafkaSettings, topics: list[str], floors: dict[str, dict[int, int]]) -> set[str]:
    """Digests named by the pointers of the retained records of `topics`, each topic read
    from max(log start, its floor) to its end."""
    out: set[str] = set()
    for topic in topics:
        with TopicScan(kafka, topic) as scan:
            floor = floors.get(topic, {})
            scan.seek({p: max(o, floor.get(p, 0)) for p, o in scan.log_starts().items()})
            while not all(scan.done(p) for p in scan.partitions):
                for m in scan.poll(only={p for p in scan.partitions if not scan.done(p)}):
                    if (sha := pointer_digest(m.value)) is not None:
                        out.add(sha)
    return out


def collect(store: BlobStore, kafka: KafkaSettings, topics: list[str], floors: dict[str, dict[int, int]],
            min_age_s: float, dry_run: bool = False) -> GcReport:
    now = time.time()
    listed = list(store.blobs())  # before the topics are read: a blob stored meanwhile is no candidate
    refs = referenced(kafka, topics, floors)
    report = GcReport(blobs=sum(not b.temporary for b in listed), referenced=len(refs), dry_run=dry_run)
    for b in listed:
        if not b.temporary and b.name in refs:
            report.kept_referenced += 1
        elif now - b.mtime < min_age_s:
            report.kept_young += 1
        else:
            _delete(store, b, report, dry_run)
    return report


def _delete(store: BlobStore, b: BlobFile, report: GcReport, dry_run: bool) -> None:
    if b.temporary:
        report.temporaries_deleted += 1
    else:
        report.deleted += 1
        report.deleted_bytes += b.nbytes
    if not dry_run:
        store.delete(b)
        log.debug("deleted %s (%d bytes)", b.path, b.nbytes)
