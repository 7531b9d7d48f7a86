"""The control plane's Kafka side: the follower every service runs and the writer.

`ControlFollower` tails the control and policy topics from the beginning and
keeps a `ControlView` (current settings, newest announcement). `poll()` takes
what has arrived (cheap: the producer calls it between engine steps);
`catch_up()` reads to the topics' ends as the broker reports them at the
call, so every message acknowledged before the call is applied when it
returns (the consumer calls it at each batch boundary, services at start).
`ControlPlaneWriter` writes validated control changes and announcements. The
message types live in `common/control/messages.py`.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from common import metrics
from common.config import ControlSettings, KafkaSettings
from common.control.messages import (AUTO, CONTROLLER, ControlChange, TrainerProgress, WeightsReady,
                                     encode_control, parse_control_value, parse_policy_message)
from common.errors import ConfigError
from common.kafka.client import make_consumer, make_producer

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
                            "Control or policy messages ignored as malformed or out of range", ["topic"])
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
    next batch.
    """

    def __init__(self, kafka: KafkaSettings, initial: ControlSettings):
        from kafka import TopicPartition

        self.view = ControlView(state=initial.model_copy())
        self._topics = {kafka.topics.control: "control", kafka.topics.policy: "policy"}
        self._consumer = make_consumer(kafka, fetch_max_wait_ms=50, max_partition_fetch_bytes=1 << 20)
        self._tps = [TopicPartition(t, p) for t in self._topics
                     for p in sorted(self._consumer.partitions_for_topic(t) or {0})]
        self._consumer.assign(self._tps)
        self._consumer.seek_to_beginning(*self._tps)
        _export(self.view.state)

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
                change = self._apply(self._topics.get(tp.topic, "?"), m.key, m.value)
                if change:
                    changes.append(change)
        if any(isinstance(c, ControlChange) for c in changes):
            _export(self.view.state)
        return changes

    def _apply(self, kind: str, key: bytes | None, value: bytes | None):
        try:
            if kind == "policy":
                return self._apply_policy(parse_policy_message(value or b""))
            k = (key or b"").decode()
            record = json.loads(value or b"null")
            v = parse_control_value(k, record["value"])
        except (ValidationError, ConfigError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            _REJECTED.labels(topic=kind).inc()
            log.warning("ignoring malformed %s message (key=%r): %s", kind, key, e)
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


class ControlPlaneWriter:
    """Writes to the control and policy topics (admin changes, announcements).

    Not idempotent on purpose: control values and announcements are absolute
    (re-sending one is harmless), and kafka-python's idempotent producer stays
    wedged after its batches expire in a broker outage.
    """

    def __init__(self, kafka: KafkaSettings):
        self.kafka = kafka
        self._p = make_producer(kafka, "control")

    def set_control(self, key: str, value: Any, by: str, reason: str | None = None) -> Any:
        """Validate, write and wait for the broker's acknowledgement; return the typed value."""
        k, v = encode_control(key, value, by=by, reason=reason)
        self._p.send(self.kafka.topics.control, key=k, value=v).get(timeout=30)
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
        """Send one policy-topic message (keyed by its kind) and wait for the ack."""
        self._p.send(self.kafka.topics.policy, key=msg.kind.encode(),
                     value=msg.model_dump_json().encode()).get(timeout=30)

    def close(self) -> None:
        self._p.close(timeout=10)

