"""The dead-letter writer: refused records -> `kafka.topics.dlq`, confirmed before the caller moves on.

A dead letter is the refused message as it was (original key, value and
headers) plus three headers that say why:

| header            | value                                                         |
|-------------------|---------------------------------------------------------------|
| `rlstream-reason` | the error message, UTF-8, at most 4,000 bytes                  |
| `rlstream-field`  | the offending field (`logprobs`, `key`, `<bytes>`, `prompt`...) |
| `rlstream-source` | `topic/partition/offset` of the refused message                |

Contract (what `RolloutReader` and the producer's `KafkaPromptSource` build
on): `confirm()` returns only once the broker acknowledged (acks=all) every
letter `send()` queued since the previous `confirm()`; so a caller that
advances its position only after `confirm()` never moves past a refused record
that is not stored. If a send or the confirmation fails, the writer raises
`BrokerError`, forgets the unconfirmed letters and drops its producer (the
next `send()` builds a fresh one: a producer that failed a delivery may stay
wedged); the caller re-reads those records and sends them again, so the DLQ
may hold a record twice. Counting dead letters (metrics, outcomes) is the
caller's business: only the caller knows what it refused. Single-threaded.
"""
from __future__ import annotations

import logging
from typing import NoReturn, Protocol

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import BrokerError
from rlstream.common.kafka.client import make_producer

log = logging.getLogger("rlstream.dlq")

H_REASON, H_FIELD, H_SOURCE = "rlstream-reason", "rlstream-field", "rlstream-source"
MAX_REASON_BYTES = 4000


class Refused(Protocol):
    """What a dead letter is made of: a kafka-python ConsumerRecord has all of it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list | None


def dead_letter_headers(m: Refused, field: str, reason: str) -> list[tuple[str, bytes]]:
    """The refused message's own headers plus reason, field and source."""
    return list(m.headers or []) + [
        (H_REASON, reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]),
        (H_FIELD, field.encode("utf-8", "replace")),
        (H_SOURCE, f"{m.topic}/{m.partition}/{m.offset}".encode()),
    ]


class DeadLetterWriter:
    """Sends refused messages to the DLQ topic; `confirm()` waits for the broker (see the module docstring)."""

    def __init__(self, kafka: KafkaSettings):
        self.kafka = kafka
        self.topic = kafka.topics.dlq
        self._producer = None
        self._unconfirmed: list = []  # kafka-python futures of letters sent since the last confirm()

    def send(self, m: Refused, field: str, reason: str) -> None:
        """Queue one dead letter (not yet stored: call `confirm()`). BrokerError if it cannot be sent."""
        log.warning("invalid record %s/%d/%d -> %s: field %s: %s", m.topic, m.partition, m.offset, self.topic,
                    field, reason[:200])
        try:
            if self._producer is None:
                self._producer = make_producer(self.kafka, "dlq")
            self._unconfirmed.append(self._producer.send(self.topic, key=m.key, value=m.value or b"",
                                                         headers=dead_letter_headers(m, field, reason)))
        except Exception as e:
            self._fail(e)

    def confirm(self) -> int:
        """Wait until the broker stored every letter sent since the last call; returns how many.

        BrokerError if one was not stored (then none of them counts as stored).
        """
        letters, self._unconfirmed = self._unconfirmed, []
        timeout = 2 * self.kafka.request_timeout_ms / 1000 + 5
        try:
            for fut in letters:
                fut.get(timeout=timeout)
        except Exception as e:
            self._fail(e)
        return len(letters)

    def _fail(self, e: Exception) -> NoReturn:
        self._unconfirmed = []
        if self._producer is not None:
            try:
                self._producer.close(timeout=0)
            except Exception:  # noqa: BLE001 - it failed already; the next send builds a new one
                pass
            self._producer = None
        raise BrokerError(f"could not store dead letter(s) in {self.topic} ({type(e).__name__}: {e})") from e

    def close(self, timeout: float = 5.0) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - closing must not fail a shutdown
                log.warning("DLQ producer did not close cleanly: %s", e)
            self._producer = None
