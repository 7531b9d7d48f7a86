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
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.config import StalenessSettings
from common.errors import ConfigError

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
