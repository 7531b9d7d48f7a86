"""Control-plane messages: runtime settings and the policy topic's typed messages.

Two small topics, both JSON, both read from the beginning by every service:

- `rlstream.control` (compacted): one key per setting of
  `rlstream.common.config.ControlSettings` (`max_staleness`, `mode`, `decay`, `paused`:
  their types and bounds are declared there, once, for the config file and
  the control plane); the value is `{"value": ..., "by": ..., "at": ...}`.
  The newest value per key wins, so a restarted service recovers the current
  settings from the topic.
- `rlstream.policy`: two kinds of message, tagged by `kind` (the Kafka key is
  the kind too): `WeightsReady` (a new policy version, how it travels and
  where its durable copy is; the newest version wins) and `TrainerProgress`
  (the trainer's version, read offsets, held records, batch shape and filtered
  share; the newest message wins), which producers size their staleness
  backpressure from.

Values are validated on both ends: `ctl set` refuses bad values before
writing, and a follower ignores (and counts) an out-of-range or malformed
message instead of applying it. Nothing is unpickled or evaluated: JSON only.

Types are strict (`parse_control_value`): a JSON value must already have its
setting's type: `max_staleness` an integer (`true` is not 1, `2.0` and "2" are
not 2), `decay` a number (not a boolean), `paused` and `max_staleness_auto`
true or false, `mode` a string. Only `rlstream ctl`, whose values are
command-line text, parses text first (`parse_control_text`).

`max_staleness: auto` (docs/stability.md): the consumer's controller writes
`max_staleness` as `CONTROLLER` with a `reason`; an operator's
`max_staleness` N (`ControlPlaneWriter.set_by_operator`) first writes
`max_staleness_auto: false`, and followers ignore the controller's records
while that holds; `max_staleness` "auto" writes `max_staleness_auto: true`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from rlstream.common.config import ControlSettings
from rlstream.common.errors import ConfigError

CONTROL_KEYS = tuple(ControlSettings.model_fields)
"""The keys of the control topic: max_staleness, mode, decay, paused, max_staleness_auto."""
AUTO = "auto"
"""An operator's `max_staleness` value that hands the bound to the controller."""
CONTROLLER = "staleness-controller"
"""The `by` of the controller's records (consumer/stability/auto.py)."""



@dataclass(frozen=True)
class DurableCopy:
    """A version in the durable weight store (common/weights/store.py): what `verify` needs."""

    version: int
    uri: str
    sha256: str
    bytes: int


class WeightsReady(BaseModel):
    """The consumer published a new policy version (`kind: weights_ready`).

    `transport` says how the version travels (docs/weights.md):

    - `file`: the version is in the durable store at `uri` (`sha256`, `bytes`
      of its model.safetensors); producers stage, verify and reload it.
    - `collective`: the trainer streams it with `backend` to every producer
      linked at `endpoint`; the link is the version's one control channel (its
      finish carries the digest the producer checks). `durable_*` name the newest
      durable copy (an older version, written every `consumer.weights.durable_every`
      versions), from which producers that start late, restart or miss a transfer
      catch up.

    Producers take it between engine steps once it verifies; the newest
    version wins.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["weights_ready"] = "weights_ready"
    version: int = Field(ge=0)
    transport: Literal["file", "collective"]
    uri: str | None = Field(None, min_length=1)
    """file: where the version lives (file:// URI of a weight-store directory)."""
    sha256: str | None = Field(None, min_length=64, max_length=64)
    bytes: int | None = Field(None, ge=1)
    digest: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """collective: the version digest (blake3, hex) of the weights the trainer streams. Producers
    check the one the trainer's finish on the link carries, not this one; here it names the
    version's weights on the policy topic, so that a version number re-announced (with its durable
    copy, at shutdown) can be told to hold the same weights."""
    endpoint: str | None = Field(None, pattern=r"^[^\s:]+:\d{1,5}$")
    """collective: host:port of the trainer's weight endpoint (common/weights/link.py)."""
    backend: Literal["rlstream_gloo", "nccl"] | None = None
    """collective: the weight-transfer backend the trainer sends with (named once, by the trainer's
    `consumer.weights.backend`). A producer whose engine uses another one does not link: it says
    why in its weight state and takes the durable copies."""
    durable_version: int | None = Field(None, ge=0)
    durable_uri: str | None = Field(None, min_length=1)
    durable_sha256: str | None = Field(None, min_length=64, max_length=64)
    durable_bytes: int | None = Field(None, ge=1)
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _complete(self):
        if self.transport == "file" and None in (self.uri, self.sha256, self.bytes):
            raise ValueError("transport file needs uri, sha256 and bytes")
        if self.transport == "collective" and None in (self.endpoint, self.backend):
            raise ValueError("transport collective needs an endpoint and a backend")
        durable = (self.durable_version, self.durable_uri, self.durable_sha256, self.durable_bytes)
        if any(v is not None for v in durable) and None in durable:
            raise ValueError("durable_version, durable_uri, durable_sha256 and durable_bytes go together")
        if self.durable_version is not None and self.durable_version > self.version:
            raise ValueError("durable_version is newer than version")
        return self

    def durable_copy(self) -> DurableCopy | None:
        """The newest durable copy this message names: the version itself (file), or durable_* (collective)."""
        if self.transport == "file":
            return DurableCopy(self.version, self.uri, self.sha256, self.bytes)
        if self.durable_version is None:
            return None
        return DurableCopy(self.durable_version, self.durable_uri, self.durable_sha256, self.durable_bytes)


class TrainerProgress(BaseModel):
    """Where the trainer is (`kind: trainer_progress`): what producers size
    their staleness backpressure from (producer/admission.py `admission_block`).

    Sent after every global step and, while the trainer waits for data, about
    once a second when it changed. The newest message in the log wins.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["trainer_progress"] = "trainer_progress"
    trainer_version: int = Field(ge=0)
    """The version the trainer's next optimizer step produces minus one:
    the number of completed global steps."""
    read_offsets: dict[int, int] = Field(default_factory=dict)
    """Per rollouts partition, the next offset the trainer will read."""
    held_records: int = Field(0, ge=0)
    """Records the trainer has read but not yet trained or dropped (partial
    groups, complete groups waiting for a batch). Producers count the groups
    queued ahead of a new one as (records past `read_offsets` + held_records)
    / G. (The checkpointed offsets would over-count: one held group pins them
    while records behind it are consumed, which once stalled the pipeline.)"""
    groups_per_batch: int = Field(ge=1)
    """B: groups per global step, so producers never read the consumer's config."""
    group_size: int = Field(ge=1)
    """G: samples per group."""
    filtered_share: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the trainer's recent groups (within the staleness bound) that
    dynamic sampling filtered for equal rewards (consumer/stream/gate.py
    `FilteredShare`): each global step takes about B / (1 - share) queued groups,
    so producers scale their queue estimate by (1 - share). 0 without filtering."""
    created_at: float = Field(default_factory=time.time)


PolicyMessage = Annotated[Union[WeightsReady, TrainerProgress], Field(discriminator="kind")]
_POLICY_MESSAGE = TypeAdapter(PolicyMessage)


def parse_policy_message(value: bytes) -> WeightsReady | TrainerProgress:
    """One message of the policy topic; raises pydantic's ValidationError."""
    return _POLICY_MESSAGE.validate_json(value)


@dataclass(frozen=True)
class ControlChange:
    """A runtime setting changed (the follower's event for the control topic)."""

    key: str
    value: Any


def parse_control_value(key: str, value: Any) -> Any:
    """Validate one setting's JSON value, strictly typed (module docstring).

    Returns the value; raises ConfigError naming the key.
    """
    if key not in CONTROL_KEYS:
        raise ConfigError(f"unknown control key; choose one of {', '.join(CONTROL_KEYS)}", key=key)
    try:
        # strict: no bool -> int, no str -> number, no 1 -> true (an int is still a valid float)
        return getattr(ControlSettings.model_validate({key: value}, strict=True), key)
    except ValidationError as e:
        raise ConfigError(f"{e.errors()[0]['msg']}, got {value!r}", key=key) from None


def parse_control_text(key: str, text: str) -> Any:
    """A setting given as command-line text (`rlstream ctl set KEY TEXT`), validated."""
    if key not in CONTROL_KEYS:
        raise ConfigError(f"unknown control key; choose one of {', '.join(CONTROL_KEYS)}", key=key)
    t = text.strip().lower()
    if key == "max_staleness" and t == AUTO:
        return AUTO
    if key in ("paused", "max_staleness_auto"):
        if t not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"must be true or false, got {text!r}", key=key)
        return parse_control_value(key, t in ("true", "1", "yes"))
    if key in ("max_staleness", "decay"):
        kind = int if key == "max_staleness" else float
        try:
            value = kind(t)
        except ValueError:
            raise ConfigError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}",
                              key=key) from None
        return parse_control_value(key, value)
    return parse_control_value(key, t)


def encode_control(key: str, value: Any, by: str, reason: str | None = None) -> tuple[bytes, bytes]:
    """(kafka key, kafka value) for one validated control change (`reason`: why, when given)."""
    value = parse_control_value(key, value)
    record = {"value": value, "by": by, "at": time.time()}
    if reason is not None:
        record["reason"] = str(reason)
    return key.encode(), json.dumps(record).encode()
