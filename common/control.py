"""Control-plane messages and the follower that every service runs.

Two small topics, both JSON, both read from the beginning by every service:

- `rlstream.control` (compacted): one key per setting (`max_staleness`, `mode`,
  `decay`, `paused`); the value is `{"value": ..., "by": ..., "at": ...}`. The
  newest value per key wins, so a restarted service recovers the current
  settings from the topic.
- `rlstream.policy`: `PolicyAnnouncement` under the key `policy`; the newest
  version wins. Its `trainer_version` is the trainer's version that producers
  use for staleness backpressure. While the trainer waits for data it
  re-announces its current version with newer `read_offsets` / `held_records`
  (a progress update: producers update their backpressure estimate, nothing
  reloads).

Values are validated on both ends: `ctl set` refuses bad values before
writing, and a follower ignores (and counts) an out-of-range or malformed
message instead of applying it. Nothing is unpickled or evaluated: JSON only.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common import metrics
from common.config import KafkaSettings, StalenessSettings
from common.errors import ConfigError

log = logging.getLogger(__name__)

CONTROL_KEYS = ("max_staleness", "mode", "decay", "paused")
POLICY_KEY = b"policy"


class ControlState(BaseModel):
    """The runtime-tunable settings (same bounds as the config file's)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    max_staleness: int = Field(2, ge=0, le=1000)
    mode: str = Field("drop", pattern="^(drop|reweight)$")
    decay: float = Field(1.0, gt=0.0, le=1.0)
    paused: bool = False

    @classmethod
    def from_settings(cls, s: StalenessSettings) -> "ControlState":
        return cls(max_staleness=s.max_staleness, mode=s.mode, decay=s.decay)


class PolicyAnnouncement(BaseModel):
    """A new policy version in the weight store."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    uri: str
    sha256: str = Field(min_length=64, max_length=64)
    bytes: int = Field(ge=1)
    trainer_version: int = Field(ge=0)
    consumed_offsets: dict[int, int] = Field(default_factory=dict)
    """Per rollouts partition, the offset below which the trainer has processed
    every record (its checkpointed offsets)."""
    read_offsets: dict[int, int] | None = None
    """Per rollouts partition, the next offset the trainer will read."""
    held_records: int = Field(0, ge=0)
    """Records the trainer has read but not yet trained or dropped (partial
    groups, complete groups waiting for a batch). Producers count the groups
    queued ahead of a new one as (records past `read_offsets` + held_records)
    / G: staleness backpressure. (`consumed_offsets` would over-count: one held
    group pins it while records behind it are consumed, which once stalled
    the whole pipeline.)"""
    created_at: float = Field(default_factory=time.time)

    def trainer_progress(self) -> tuple[dict[int, int], int]:
        """(read offsets, held records) for the backpressure estimate; an
        announcement without them (an older consumer) gives its consumed
        offsets and 0 held, which over-counts but never under-counts."""
        if self.read_offsets is None:
            return dict(self.consumed_offsets), 0
        return dict(self.read_offsets), self.held_records


def parse_control_value(key: str, raw: Any) -> Any:
    """Validate one setting (`raw` may be a string from the CLI/HTTP).

    Returns the typed value; raises ConfigError naming the key.
    """
    if key not in CONTROL_KEYS:
        raise ConfigError(f"unknown control key; choose one of {', '.join(CONTROL_KEYS)}", key=key)
    if isinstance(raw, str):
        text = raw.strip().lower()
        if key == "paused":
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError("must be true or false", key=key)
            raw = text in ("true", "1", "yes")
        elif key == "max_staleness":
            try:
                raw = int(text)
            except ValueError:
                raise ConfigError(f"must be an integer, got {raw!r}", key=key) from None
        elif key == "decay":
            try:
                raw = float(text)
            except ValueError:
                raise ConfigError(f"must be a number, got {raw!r}", key=key) from None
        else:
            raw = text
    try:
        state = ControlState()
        setattr(state, key, raw)
        return getattr(state, key)
    except ValidationError as e:
        raise ConfigError(e.errors()[0]["msg"], key=key) from None


def encode_control(key: str, value: Any, by: str) -> tuple[bytes, bytes]:
    """(kafka key, kafka value) for one validated control change."""
    value = parse_control_value(key, value)
    return key.encode(), json.dumps({"value": value, "by": by, "at": time.time()}).encode()


@dataclass
class ControlView:
    """What a follower currently believes; updated by `ControlFollower.poll`."""

    state: ControlState
    policy: PolicyAnnouncement | None = None
    changes: list[tuple[str, Any]] = field(default_factory=list)


_REJECTED = metrics.counter("rlstream_control_rejected_total",
                            "Control or policy messages ignored as malformed or out of range", ["topic"])
_SETTING = metrics.gauge("rlstream_control_setting", "Current value of a runtime setting (paused: 1/0; mode: 1=reweight)", ["key"])


def _export(state: ControlState) -> None:
    _SETTING.labels(key="max_staleness").set(state.max_staleness)
    _SETTING.labels(key="decay").set(state.decay)
    _SETTING.labels(key="paused").set(1 if state.paused else 0)
    _SETTING.labels(key="mode").set(1 if state.mode == "reweight" else 0)


class ControlFollower:
    """Tails the control and policy topics (from the beginning) without a group.

    `poll()` applies every new message in order and returns the changes since
    the last call; services call it at batch boundaries, so a change takes
    effect at the next batch.
    """

    def __init__(self, kafka: KafkaSettings, initial: ControlState):
        from kafka import KafkaConsumer, TopicPartition

        from common.kafka_conn import client_kwargs

        self.view = ControlView(state=initial.model_copy())
        self._topics = {kafka.topics.control: "control", kafka.topics.policy: "policy"}
        self._consumer = KafkaConsumer(**client_kwargs(kafka), enable_auto_commit=False,
                                       group_id=None, fetch_max_wait_ms=50,
                                       max_partition_fetch_bytes=1 << 20)
        tps = [TopicPartition(t, p) for t in self._topics
               for p in sorted(self._consumer.partitions_for_topic(t) or {0})]
        self._consumer.assign(tps)
        self._consumer.seek_to_beginning(*tps)
        _export(self.view.state)

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, Any]]:
        changes: list[tuple[str, Any]] = []
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=10_000)
        for tp, msgs in batches.items():
            for m in msgs:
                change = self._apply(self._topics.get(tp.topic, "?"), m.key, m.value)
                if change:
                    changes.append(change)
        if changes:
            _export(self.view.state)
        return changes

    def _apply(self, kind: str, key: bytes | None, value: bytes | None):
        try:
            if kind == "policy":
                ann = PolicyAnnouncement.model_validate_json(value or b"")
                cur = self.view.policy
                # a newer version, or a progress update of the current one
                if cur is None or (ann.version, ann.created_at) > (cur.version, cur.created_at):
                    self.view.policy = ann
                    return ("policy", ann)
                return None
            k = (key or b"").decode()
            v = parse_control_value(k, json.loads(value or b"null")["value"])
        except (ValidationError, ConfigError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            _REJECTED.labels(topic=kind).inc()
            log.warning("ignoring malformed %s message (key=%r): %s", kind, key, e)
            return None
        if getattr(self.view.state, k) != v:
            setattr(self.view.state, k, v)
            log.info("control: %s = %r", k, v)
            return (k, v)
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
        from kafka import KafkaProducer

        from common.kafka_conn import client_kwargs

        self.kafka = kafka
        self._p = KafkaProducer(**client_kwargs(kafka), acks="all", enable_idempotence=False, retries=5)

    def set_control(self, key: str, value: Any, by: str) -> Any:
        """Validate, write and wait for the broker's acknowledgement; return the typed value."""
        k, v = encode_control(key, value, by=by)
        self._p.send(self.kafka.topics.control, key=k, value=v).get(timeout=30)
        return json.loads(v)["value"]

    def announce(self, ann: PolicyAnnouncement) -> None:
        self._p.send(self.kafka.topics.policy, key=POLICY_KEY, value=ann.model_dump_json().encode()).get(timeout=30)

    def close(self) -> None:
        self._p.close(timeout=10)

