"""The control plane's Kafka side: the follower every service runs and the writer.

`ControlFollower` tails the control and policy topics from the beginning and
keeps a `ControlView` (current settings, newest announcement). `poll()` takes
what has arrived (cheap: the producer calls it between engine steps);
`catch_up()` reads to the topics' ends as the broker reports them at the
call, so every message acknowledged before the call is applied when it
returns (the consumer calls it at each batch boundary, services at start).
`ControlPlaneWriter` writes validated control changes and announcements. The
message types live in `common/control/messages.py`.

Control records are signed with a key derived from the admin token
(common/control/signing.py): the writer signs each change, the follower applies
only those that verify and were written after the value it holds for their key.
Everything it ignores (unverified, malformed, out of range) is counted and
logged, at most one line per topic and reason every 10 s.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rlstream.common import metrics
from rlstream.common.config import ControlSettings, KafkaSettings
from rlstream.common.control import signing
from rlstream.common.control.messages import (
    AUTO,
    CONTROLLER,
    ControlChange,
    TrainerProgress,
    WeightsReady,
    encode_control,
    parse_control_value,
    parse_policy_message,
)
from rlstream.common.errors import ConfigError
from rlstream.common.kafka.client import make_consumer, make_producer
from rlstream.common.kafka.fetch_wait import FetchWait

log = logging.getLogger(__name__)

Event = ControlChange | WeightsReady | TrainerProgress
"""What `ControlFollower.poll` returns, in log order."""


@dataclass
class ControlView:
    """What a follower currently believes; updated by `ControlFollower.poll`."""

    state: ControlSettings
    weights: WeightsReady | None = None
    """The newest version announced."""
    progress: TrainerProgress | None = None
    """The trainer's latest progress message."""


_REJECTED = metrics.counter("rlstream_control_rejected_total",
                            "Control or policy messages ignored: malformed, out of range, or (control) not "
                            "verified", ["topic"])
_UNVERIFIED = metrics.counter("rlstream_control_unverified_total",
                              "Control records not applied because their signature did not verify "
                              "(common/control/signing.py)", ["reason"])
_SETTING = metrics.gauge("rlstream_control_setting", "Current value of a runtime setting (paused: 1/0; mode: 1=reweight)", ["key"])


def _export(state: ControlSettings) -> None:
    _SETTING.labels(key="max_staleness").set(state.max_staleness)
    _SETTING.labels(key="decay").set(state.decay)
    _SETTING.labels(key="paused").set(1 if state.paused else 0)
    _SETTING.labels(key="mode").set(1 if state.mode == "reweight" else 0)
    _SETTING.labels(key="max_staleness_auto").set(1 if state.max_staleness_auto else 0)


class ControlFollower:
    """Tails the control and policy topics (from the beginning) without a group.

    `poll()` applies every new message in order and returns the events since
    the last call, in log order: `ControlChange` (a setting changed),
    `WeightsReady` (a version newer than any seen), `TrainerProgress`.
    Services call it at batch boundaries, so a change takes effect at the
    next batch. `signing_key` (signing.signing_key of the service's admin
    token) verifies control records; None: no control record is applied.
    """

    def __init__(self, kafka: KafkaSettings, initial: ControlSettings, signing_key: bytes | None = None,
                 fetch_wait_ms: int = 50):
        from kafka import TopicPartition

        self.kafka = kafka
        self.view = ControlView(state=initial.model_copy())
        self._key = signing_key
        self._applied_at: dict[str, float] = {}  # control key -> `at` of the record its value came from
        self._refusals = _RefusalLog()
        if signing_key is None:
            log.warning("control: no admin token configured, so control records cannot be verified: none is "
                        "applied and the settings stay as configured; weight announcements cannot be verified "
                        "either and are taken unsigned (set RLSTREAM_ADMIN_TOKEN on every service)")
        self._topics = {kafka.topics.control: "control", kafka.topics.policy: "policy"}
        # the wait rises when tansu's listing of a long policy log outlasts it (common/kafka/fetch_wait.py)
        self.fetch_wait = FetchWait("control", fetch_wait_ms, request_timeout_ms=kafka.request_timeout_ms)
        self._consumer = self._new_consumer()
        self._tps = [TopicPartition(t, p) for t in self._topics
                     for p in sorted(self._consumer.partitions_for_topic(t) or {0})]
        self._next: dict = {}  # TopicPartition -> the next offset to apply (absent: from the beginning)
        self._assign()
        _export(self.view.state)

    def _new_consumer(self):
        return make_consumer(self.kafka, fetch_max_wait_ms=self.fetch_wait.ms, max_partition_fetch_bytes=1 << 20)

    def _assign(self) -> None:
        self._consumer.assign(self._tps)
        for tp in self._tps:
            if tp in self._next:
                self._consumer.seek(tp, self._next[tp])
            else:
                self._consumer.seek_to_beginning(tp)

    def catch_up(self, timeout_s: float = 5.0) -> list[Event]:
        """`poll()` until every message the broker holds at this call is applied.

        A plain `poll()` right after a change often returns nothing: the fetch
        that carries it is still in flight. Here the end offsets are asked
        first (ListOffsets: one round trip; on tansu exact for these topics,
        whose messages are each their own batch), then polled up to. After
        `timeout_s` (a broker that does not answer) it returns what it has;
        the next call goes on from there.
        """
        deadline = time.monotonic() + timeout_s
        try:
            ends = self._consumer.end_offsets(self._tps, timeout_ms=int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - a boundary must not fail on a slow broker
            log.warning("control catch-up: end offsets unavailable (%s); taking what has arrived", e)
            return self.poll()
        events = self.poll()
        while any(self._consumer.position(tp) < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                log.warning("control catch-up: not at the topics' ends after %.1f s", timeout_s)
                break
            events += self.poll(timeout_s=0.05)
        return events

    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        changes: list[Event] = []
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=10_000)
        for tp, msgs in batches.items():
            for m in msgs:
                change = self._apply(self._topics.get(tp.topic, "?"), m.key, m.value, m.headers)
                self._next[tp] = m.offset + 1
                if change:
                    changes.append(change)
        if not batches:
            self._adapt_fetch_wait(batches)
        if any(isinstance(c, ControlChange) for c in changes):
            _export(self.view.state)
        return changes

    def _adapt_fetch_wait(self, raw) -> None:
        at = {tp: self._next.get(tp, 0) for tp in self._tps}
        if self.fetch_wait.raise_for(self.fetch_wait.starved(self._consumer, raw, at), at):
            old, self._consumer = self._consumer, self._new_consumer()
            old.close()
            self._assign()

    def _apply(self, kind: str, key: bytes | None, value: bytes | None, headers=None):
        try:
            if kind == "policy":
                if self._key is not None:  # without a token unsigned announcements pass (the start-up warning)
                    signing.verify(self._key, key, value, headers)
                return self._apply_policy(parse_policy_message(value or b""))
            signing.verify(self._key, key, value, headers)
            k = (key or b"").decode()
            record = json.loads(value or b"null")
            v = parse_control_value(k, record["value"])
            self._check_fresh(k, record.get("at"))
        except signing.UnverifiedRecord as e:
            _REJECTED.labels(topic=kind).inc()
            _UNVERIFIED.labels(reason=e.reason).inc()
            self._refusals.note(kind, e.reason, key, str(e))
            return None
        except (ValidationError, ConfigError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            _REJECTED.labels(topic=kind).inc()
            self._refusals.note(kind, "malformed", key, str(e))
            return None
        reason = f" ({record['reason']})" if record.get("reason") else ""
        if record.get("by") == CONTROLLER and not self.view.state.max_staleness_auto:
            log.info("control: the controller's %s = %r ignored: an operator's setting holds%s", k, v, reason)
            return None
        if getattr(self.view.state, k) != v:
            setattr(self.view.state, k, v)
            log.info("control: %s = %r by %s%s", k, v, record.get("by"), reason)
            return ControlChange(k, v)
        return None

    def _check_fresh(self, key: str, at) -> None:
        """A verified record applies only if written after the one its key's value came from
        (a copy of an old signed record, written again, is `replayed`)."""
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError(f"`at` must be a finite number, got {at!r}")
        if at < self._applied_at.get(key, float("-inf")):
            raise signing.UnverifiedRecord("replayed", f"written at {at:.3f}, before the value applied for "
                                                       f"{key} (at {self._applied_at[key]:.3f}): an old record again")
        self._applied_at[key] = at

    def _apply_policy(self, msg: WeightsReady | TrainerProgress) -> Event | None:
        if isinstance(msg, TrainerProgress):
            self.view.progress = msg
            return msg
        # the newest version wins; the same version announced again (a restarted trainer:
        # its new endpoint, a newer durable copy) replaces the earlier message
        if self.view.weights is None or msg.version >= self.view.weights.version:
            self.view.weights = msg
            return msg
        return None

    def close(self) -> None:
        self._consumer.close()


class _RefusalLog:
    """One log line per (topic, reason) at most every `every_s`, with how many were ignored since:
    a flood of hostile records must not flood the log."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}
        self._since: dict[tuple[str, str], int] = {}

    def note(self, kind: str, reason: str, key: bytes | None, why: str) -> None:
        k, now = (kind, reason), time.monotonic()
        self._since[k] = self._since.get(k, 0) + 1
        if now - self._last.get(k, float("-inf")) < self.every_s:
            return
        self._last[k], n = now, self._since.pop(k)
        log.warning("ignoring %s message (%s, key=%r)%s: %s", kind, reason, (key or b"")[:64],
                    f" and {n - 1} more like it since the last line" if n > 1 else "", why[:300])


class ControlPlaneWriter:
    """Writes to the control and policy topics (admin changes, announcements).

    Control changes are signed with `signing_key` (common/control/signing.py);
    without one (no admin token) `set_control` refuses: no service would apply
    an unsigned change. Not idempotent on purpose: control values and
    announcements are absolute (re-sending one is harmless), and kafka-python's
    idempotent producer stays wedged after its batches expire in a broker outage.
    """

    def __init__(self, kafka: KafkaSettings, signing_key: bytes | None = None):
        self.kafka = kafka
        self._key = signing_key
        self._p = make_producer(kafka, "control")

    def set_control(self, key: str, value: Any, by: str, reason: str | None = None) -> Any:
        """Validate, sign, write and wait for the broker's acknowledgement; return the typed value."""
        k, v = encode_control(key, value, by=by, reason=reason)
        if self._key is None:
            raise ConfigError("no admin token configured: a control change cannot be signed, and no service "
                              "would apply it (set RLSTREAM_ADMIN_TOKEN on every service)", key=key)
        signing.publish(self._p, self.kafka.topics.control, k, v, self._key).get(timeout=30)
        return json.loads(v)["value"]

    def set_by_operator(self, key: str, value: Any, by: str) -> Any:
        """An operator's change (the admin API). `max_staleness` N takes the bound from the
        controller first (`max_staleness_auto` false), so its later records are ignored;
        `max_staleness` "auto" hands the bound back to it."""
        if key == "max_staleness" and value == AUTO:
            self.set_control("max_staleness_auto", True, by)
            return AUTO
        if key == "max_staleness":
            parse_control_value(key, value)  # a bad value changes nothing
            self.set_control("max_staleness_auto", False, by)
        return self.set_control(key, value, by)

    def announce(self, msg: WeightsReady | TrainerProgress) -> None:
        """Send one policy-topic message (keyed by its kind), signed like a control record when
        there is a key (followers with a key apply only signed announcements), and wait for the ack."""
        key, value = msg.kind.encode(), msg.model_dump_json().encode()
        if self._key is None:
            self._p.send(self.kafka.topics.policy, key=key, value=value).get(timeout=30)
        else:
            signing.publish(self._p, self.kafka.topics.policy, key, value, self._key).get(timeout=30)

    def close(self) -> None:
        self._p.close(timeout=10)

