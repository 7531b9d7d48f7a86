"""One error hierarchy for rlstream. Every error says what to do next."""
from __future__ import annotations


class RlstreamError(Exception):
    """Base of every error rlstream raises on purpose."""


class ConfigError(RlstreamError):
    """A configuration file, environment variable or flag is invalid.

    `key` is the dotted path of the offending setting (e.g. "kafka.bootstrap_servers").
    """

    def __init__(self, message: str, key: str | None = None):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class InvalidRecordError(RlstreamError):
    """A rollout record failed decoding or validation.

    `field` names the offending record field ("<bytes>" when the payload could not
    even be parsed). The reader sends such records to the dead-letter topic with
    `str(error)` as the reason; callers never crash on them.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.reason = message
        super().__init__(f"invalid record field {field!r}: {message}")


class BrokerError(RlstreamError):
    """The Kafka broker could not be started, reached or administered."""


class PublishError(RlstreamError):
    """A record could not be delivered to Kafka (after all retries)."""


class WeightStoreError(RlstreamError):
    """A weight version is missing, incomplete, or fails its size/sha256 check."""


class NotReadyError(RlstreamError):
    """A subcommand or feature whose implementation has not landed yet."""


class PipelineError(RlstreamError):
    """A supervised service (common/harness/supervisor.py) failed to start, died,
    or a wait for it timed out; the message carries the tail of its log."""
