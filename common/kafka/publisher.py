"""Rollout publisher: rollouts -> Kafka, with backpressure and retry until acknowledged.

Delivery guarantee (at least once, never a false success):
- A `PublishFuture` succeeds only in kafka-python's success callback for a
  produce request the broker acknowledged with acks=all; its `Delivery` names
  the topic, partition and offset that hold the record. It never succeeds for
  a record the broker did not acknowledge.
- A delivery that fails for a transient reason (kafka-python's delivery
  timeout during an outage, a lost connection, producer-state errors after
  one) is re-sent, same key and bytes, on a freshly built KafkaProducer (an
  idempotent producer whose batches expired stays wedged in kafka-python), until
  the broker acknowledges it or `close()` is called. A record the broker
  stored but whose acknowledgement was lost is then stored twice: duplicates
  after a retry are possible and the consumer drops them by `rollout_id`.
- A permanent error (record too large, authorization, invalid topic) fails the
  future with `PublishError`; `close()` fails every still-unacknowledged future
  with `PublishError`. Nothing is ever dropped silently.

Backpressure: at most `kafka.publish_buffer_records` records are
unacknowledged at any time; `publish` blocks while the buffer is full (it is
the producer service's admission control), `try_publish` returns None instead.
Blocking logs a warning (at most every 30 s) and counts
`rlstream_publish_blocked_total`.

Ordering: records with the same key (group id) go to the same partition, in
publish order, as long as no retry happens (idempotent producer, at most 5
in-flight requests). A re-sent record lands after records published later;
the consumer's group assembler does not depend on order within a group.

Claim check: an encoded record larger than `kafka.claim_check_bytes` is
written to the blob store and a small pointer is published in its place.

Threads: callers; one dispatch thread that owns the KafkaProducer (all sends,
rebuilds); kafka-python's sender thread (completes futures).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from rlstream.common import metrics
from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError, PublishError
from rlstream.common.kafka.broker import broker_api_keys
from rlstream.common.kafka.claimcheck import AbstractBlobStore, open_blob_store
from rlstream.common.kafka.client import client_kwargs, make_producer
from rlstream.common.record import ClaimPointer, Rollout, encode, encode_claim_pointer

log = logging.getLogger("rlstream.publisher")

_PUBLISHED = metrics.counter("rlstream_published_records_total", "Records the broker acknowledged", ["topic"])
_PUBLISHED_BYTES = metrics.counter("rlstream_published_bytes_total", "Value bytes the broker acknowledged", ["topic"])
_RETRIES = metrics.counter("rlstream_publish_retries_total", "Records re-sent after a failed delivery")
_FAILED = metrics.counter("rlstream_publish_failures_total", "Records failed permanently (future raised)", ["reason"])
_CLAIMS = metrics.counter("rlstream_claim_checks_total", "Records published through the claim check")
_REBUILDS = metrics.counter("rlstream_publisher_rebuilds_total", "KafkaProducers replaced after a failed delivery")
_BLOCKED = metrics.counter("rlstream_publish_blocked_total", "publish calls that waited on a full buffer")
_LATENCY = metrics.histogram("rlstream_publish_latency_seconds", "publish call to broker acknowledgement")
_DEPTH = metrics.gauge("rlstream_publish_buffer_records", "Unacknowledged records held by publishers")

# kafka-python errors after which re-sending the same bytes cannot succeed.
_PERMANENT = ("MessageSizeTooLargeError", "RecordListTooLargeError", "InvalidTopicError",
              "TopicAuthorizationFailedError", "ClusterAuthorizationFailedError",
              "TransactionalIdAuthorizationFailedError", "UnsupportedVersionError",
              "UnsupportedForMessageFormatError", "InvalidRequiredAcksError", "KafkaConfigurationError",
              "UnsupportedCompressionTypeError", "InvalidRecordError", "CorruptRecordError",
              "RecordTooLargeError", "PolicyViolationError", "SaslAuthenticationFailedError")
_STOP = object()


@dataclass(frozen=True)
class Delivery:
    """Where the broker stored an acknowledged record."""

    topic: str
    partition: int
    offset: int
    attempts: int
    """1 unless the record was re-sent after a failed delivery."""
    nbytes: int
    """Bytes of the Kafka value (the pointer's size for a claim-checked record)."""
    claim_check: bool


class PublishFuture(Future):
    """Completes with a `Delivery` once the broker acknowledged the record,
    or raises `PublishError`. Never succeeds for an unacknowledged record."""

    def __init__(self, key: bytes | None, rollout_id: str | None):
        super().__init__()
        self.key = key
        self.rollout_id = rollout_id


@dataclass(eq=False)
class _Entry:
    topic: str
    key: bytes | None
    value: bytes
    headers: list
    future: PublishFuture
    claim: bool
    t0: float = field(default_factory=time.monotonic)
    attempts: int = 0
    gen: int = -1
    done: bool = False


def _is_permanent(e: BaseException) -> bool:
    return type(e).__name__ in _PERMANENT


class RolloutPublisher:
    """Publishes rollouts to `kafka.topics.rollouts`, keyed by group id.

    See the module docstring for the delivery guarantee, backpressure and
    ordering. Use as a context manager or call `close()`.
    """

    def __init__(self, kafka: KafkaSettings, blobs: AbstractBlobStore | None = None, *,
                 linger_ms: int = 2, producer_overrides: dict | None = None):
        self.kafka = kafka
        self.topic = kafka.topics.rollouts
        self._blobs = blobs
        self._cap = kafka.publish_buffer_records
        self._linger_ms = linger_ms
        self._overrides = dict(producer_overrides or {})
        self._cond = threading.Condition()
        self._pending: dict[int, _Entry] = {}
        self._closing = False
        self._warned_full_at = -1e9
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._gen = 0
        self._api_version = None
        self.idempotent = self._idempotence_supported()
        self._producer = self._new_producer()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="rlstream-publisher", daemon=True)
        self._dispatcher.start()

    # ------------------------------------------------------------- public API
    def publish(self, rollout: Rollout, timeout: float | None = None) -> PublishFuture:
        """Encode (validating), admit, and send one rollout.

        Blocks while `publish_buffer_records` records are unacknowledged;
        raises PublishError if no room frees up within `timeout` seconds
        (None: wait indefinitely). InvalidRecordError if the rollout is invalid.
        """
        value = encode(rollout)
        fut = self._admit_and_send(rollout.group_id.encode(), value, None, self.topic, rollout.rollout_id,
                                   block=True, timeout=timeout, rollout=rollout)
        assert fut is not None
        return fut

    def try_publish(self, rollout: Rollout) -> PublishFuture | None:
        """Like `publish`, but returns None at once when the buffer is full."""
        value = encode(rollout)
        return self._admit_and_send(rollout.group_id.encode(), value, None, self.topic, rollout.rollout_id,
                                    block=False, timeout=None, rollout=rollout)

    def publish_bytes(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None = None,
                      topic: str | None = None, timeout: float | None = None) -> PublishFuture:
        """Send raw bytes (no encoding, no claim check) with the same guarantee and backpressure."""
        fut = self._admit_and_send(key, bytes(value), headers, topic or self.topic, None,
                                   block=True, timeout=timeout, rollout=None)
        assert fut is not None
        return fut

    @property
    def buffer_depth(self) -> int:
        """Records published but not yet acknowledged (or failed)."""
        with self._cond:
            return len(self._pending)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published record was acknowledged or failed.

        Raises PublishError if records remain unacknowledged after `timeout` s.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, timeout):
                raise PublishError(f"{len(self._pending)} record(s) still unacknowledged after {timeout} s; "
                                   "is the broker reachable? (they are still being retried)")

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush up to `timeout` s, then stop. Futures still unacknowledged fail with PublishError."""
        with self._cond:
            if self._closing:
                return
        try:
            self.flush(timeout)
        except PublishError as e:
            log.warning("closing publisher with unacknowledged records: %s", e)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._q.put(_STOP)
        self._dispatcher.join(max(1.0, self.kafka.request_timeout_ms / 1000 + 1))
        self._abandon(self._producer, graceful=True)
        with self._cond:
            left = list(self._pending.values())
        for e in left:
            self._finish(e, exc=PublishError(f"publisher closed before the broker acknowledged record "
                                             f"{e.future.rollout_id or e.key!r} (attempts={e.attempts}); "
                                             "publish it again"), reason="closed")

    def __enter__(self) -> "RolloutPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------- admission
    def _admit_and_send(self, key, value, headers, topic, rollout_id, *, block, timeout, rollout):
        with self._cond:
            if self._closing:
                raise PublishError("publisher is closed")
            if len(self._pending) >= self._cap:
                if not block:
                    return None
                _BLOCKED.inc()
                now = time.monotonic()
                if now - self._warned_full_at > 30.0:
                    self._warned_full_at = now
                    log.warning("publish buffer full (%d unacknowledged records): blocking producers until the "
                                "broker catches up", self._cap)
                ok = self._cond.wait_for(lambda: self._closing or len(self._pending) < self._cap, timeout)
                if self._closing:
                    raise PublishError("publisher is closed")
                if not ok:
                    raise PublishError(f"publish buffer full for {timeout} s ({self._cap} records unacknowledged); "
                                       "the broker is slow or unreachable")
            fut = PublishFuture(key, rollout_id)
            entry = _Entry(topic, key, value, list(headers or []), fut, claim=False)
            self._pending[id(entry)] = entry
            _DEPTH.inc()
        try:
            if rollout is not None and len(value) > self.kafka.claim_check_bytes:
                entry.value, entry.claim = self._claim_check(rollout, value), True
        except BaseException as e:
            self._finish(entry, exc=e)
            raise
        self._q.put((entry, None, -1))
        return fut

    def _claim_check(self, rollout: Rollout, value: bytes) -> bytes:
        if self._blobs is None:
            self._blobs = open_blob_store(self.kafka.blob_dir)
        uri, sha, n = self._blobs.put(value)
        _CLAIMS.inc()
        return encode_claim_pointer(ClaimPointer(rollout.rollout_id, rollout.group_id, uri, sha, n))

    # -------------------------------------------------------------- completion
    def _finish(self, entry: _Entry, meta=None, exc: BaseException | None = None, reason: str = "") -> None:
        with self._cond:
            if entry.done:
                return
            entry.done = True
            self._pending.pop(id(entry), None)
            _DEPTH.dec()
            self._cond.notify_all()
        if exc is None:
            _PUBLISHED.labels(entry.topic).inc()
            _PUBLISHED_BYTES.labels(entry.topic).inc(len(entry.value))
            _LATENCY.observe(time.monotonic() - entry.t0)
            entry.future.set_result(Delivery(meta.topic, meta.partition, meta.offset, entry.attempts,
                                             len(entry.value), entry.claim))
        else:
            reason = reason or type(exc).__name__
            if not isinstance(exc, PublishError):
                exc = PublishError(f"delivery of {entry.future.rollout_id or entry.key!r} to {entry.topic} failed "
                                   f"permanently: {type(exc).__name__}: {exc}")
            _FAILED.labels(reason).inc()
            entry.future.set_exception(exc)

    def _on_success(self, entry: _Entry, meta) -> None:  # kafka-python sender thread
        self._finish(entry, meta=meta)

    def _on_error(self, entry: _Entry, gen: int, exc: BaseException) -> None:  # kafka-python sender thread
        if not entry.done:
            self._q.put((entry, exc, gen))

    # ---------------------------------------------------------------- dispatch
    def _dispatch_loop(self) -> None:
        last_rebuild = 0.0
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            entry, exc, gen = item
            if entry.done:
                continue
            if exc is not None:
                if _is_permanent(exc) and gen == self._gen:
                    self._finish(entry, exc=exc)
                    continue
                _RETRIES.inc()
                if gen == self._gen:  # first failure seen on the current producer: replace it
                    wait = self.kafka.retry_backoff_ms / 1000 - (time.monotonic() - last_rebuild)
                    if wait > 0 and self._sleep(wait):
                        return
                    log.warning("delivery to %s failed (%s: %s); replacing the producer and re-sending "
                                "unacknowledged records", entry.topic, type(exc).__name__, exc)
                    if not self._rebuild():
                        return
                    last_rebuild = time.monotonic()
            self._send(entry)

    def _send(self, entry: _Entry) -> None:
        entry.attempts += 1
        entry.gen = gen = self._gen
        try:
            f = self._producer.send(entry.topic, value=entry.value, key=entry.key, headers=entry.headers or None)
        except Exception as e:  # sync failures: too large, metadata timeout, producer closed
            if _is_permanent(e):
                self._finish(entry, exc=e)
            else:
                self._q.put((entry, e, gen))
            return
        f.add_callback(self._on_success, entry)
        f.add_errback(self._on_error, entry, gen)

    def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on close. True if closing."""
        with self._cond:
            self._cond.wait_for(lambda: self._closing, seconds)
            return self._closing

    def _rebuild(self) -> bool:
        """Replace the producer; the old one's unfinished batches fail and come back re-sent."""
        old = self._producer
        while True:
            try:
                self._producer = self._new_producer()
                break
            except Exception as e:
                log.warning("cannot create a Kafka producer (%s); retrying", e)
                if self._sleep(self.kafka.retry_backoff_ms / 1000):
                    return False
        self._gen += 1
        _REBUILDS.inc()
        self._abandon(old, graceful=False)
        return True

    # ---------------------------------------------------------------- producer
    def _idempotence_supported(self) -> bool:
        """Measured via ApiVersions on a plaintext listener: InitProducerId (key 22)."""
        if "enable_idempotence" in self._overrides:
            return bool(self._overrides["enable_idempotence"])
        if self.kafka.security_protocol != "PLAINTEXT":
            return True  # real clusters (Kafka >= 0.11) support it

        host, _, port = client_kwargs(self.kafka)["bootstrap_servers"][0].rpartition(":")
        keys = broker_api_keys(host, int(port or 9092), timeout_s=self.kafka.request_timeout_ms / 1000)
        if keys is not None and 22 not in keys:
            log.warning("broker at %s does not support InitProducerId: publishing without idempotence "
                        "(broker-side retries may duplicate records; the consumer dedups by rollout_id)",
                        self.kafka.bootstrap_servers)
            return False
        return True

    def _new_producer(self):
        """A producer of role "rollouts" (common/kafka/client.py) with this publisher's idempotence and linger."""
        cfg = dict(enable_idempotence=self.idempotent, linger_ms=self._linger_ms,
                   delivery_timeout_ms=2 * self.kafka.request_timeout_ms + self._linger_ms)
        if self._api_version is not None:
            cfg["api_version"] = self._api_version  # no bootstrap round trip (works while the broker is down)
        cfg.update({k: v for k, v in self._overrides.items() if k != "enable_idempotence"})
        try:
            p = make_producer(self.kafka, "rollouts", **cfg)
        except BrokerError as e:
            raise PublishError(str(e)) from e
        self._api_version = p.config["api_version"]
        return p

    @staticmethod
    def _abandon(p, graceful: bool) -> None:
        """Close a producer without waiting on a broker that may be gone.

        kafka-python's close(0) raises while batches are incomplete; then its
        sender is force-closed, which fails those batches (their errbacks
        re-queue the records for the new producer).
        """
        try:
            p.close(timeout=1.0 if graceful else 0)
            return
        except Exception:
            pass
        sender = getattr(p, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(5)
        try:
            p.close(timeout=0)
        except Exception as e:
            log.debug("abandoned producer did not close cleanly: %s", e)
