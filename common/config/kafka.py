"""The messaging sections: `kafka` (clients, topics, claim check) and `broker`
(the embedded tansu broker)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlstream.common.config.base import _Section


class TopicSettings(_Section):
    rollouts: str = "rlstream.rollouts"
    """Rollout records, one message per sample, keyed by group id."""
    policy: str = "rlstream.policy"
    """Weight announcements (version, uri, sha256, bytes)."""
    control: str = "rlstream.control"
    """Runtime control (compacted): max_staleness, mode, decay, pause."""
    dlq: str = "rlstream.dlq"
    """Dead letters: records that failed decoding or validation, with a reason header."""
    journal: str | None = None
    """Durable partial episodes (compacted, keyed by episode; producer/journal/). None:
    `<rollouts>.journal`, so every rollouts topic has its own journal."""
    rollouts_partitions: int = Field(4, ge=1, le=1024)
    """Partitions of the rollouts topic (a group stays in one partition)."""
    replication_factor: int = Field(1, ge=1, le=16)
    """Replication of created topics (1 for the embedded broker, 3 on a cluster)."""


class KafkaSettings(_Section):
    bootstrap_servers: str | None = None
    """host:port[,host:port]. Unset: start the embedded (bundled tansu) broker."""
    client_id: str = "rlstream"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Passed through to kafka-python for real clusters."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"] | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    topics: TopicSettings = TopicSettings()
    max_message_bytes: int = Field(64 << 20, ge=1 << 20, le=1 << 30)
    """Largest message the topics and clients accept (rollouts carry routing)."""
    claim_check_bytes: int = Field(8 << 20, ge=1024)
    """Records larger than this go through the claim check (blob store + pointer)."""
    blob_dir: str = "runs/blobs"
    """Directory of the claim-check blob store (shared storage on a cluster)."""
    compression: Literal["none", "gzip", "lz4", "zstd"] = "none"
    """Producer compression of rollout batches."""
    publish_buffer_records: int = Field(256, ge=1, le=1_000_000)
    """Records a publisher holds unacknowledged before `publish` blocks (backpressure)."""
    request_timeout_ms: int = Field(30_000, ge=1000)
    retry_backoff_ms: int = Field(200, ge=10)

    @model_validator(mode="after")
    def _claim_fits(self):
        if self.claim_check_bytes > self.max_message_bytes:
            raise ValueError("claim_check_bytes must be <= max_message_bytes")
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ValueError("sasl_mechanism is required with a SASL security_protocol")
        return self


class BrokerSettings(_Section):
    host: str = "127.0.0.1"
    """Loopback by default: the embedded broker is for one machine."""
    port: int = Field(9092, ge=0, le=65535)
    """0 picks a free port."""
    storage: str = "memory://tansu/"
    """tansu storage engine URL. The bundled build has memory storage only."""
    start_timeout_s: float = Field(30.0, gt=0)
