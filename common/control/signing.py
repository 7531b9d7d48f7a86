"""Signed control records: every service can check that a change came from a holder of the admin token.

    key = signing_key(admin_token)                       # None without a token
    publish(producer, topic, b"max_staleness", value, key)   # the one way to write the control topic
    verify(key, record.key, record.value, record.headers)    # the one check every reader makes

The admin API asks for the bearer token, but the control topic is a Kafka
topic: anyone who may write to it could set `paused: true` for every service.
So each record carries an HMAC-SHA256 over its Kafka key and value in the
header `rlstream-signature` (`v1:<hex>`), made with a key derived from the
admin token (`signing_key`: HMAC-SHA256 of a fixed label under the token, so
the token itself never leaves the service), and `ControlFollower`
(common/control/plane.py) applies a record only if `verify` passes. A record
that does not verify is not applied, is counted in
`rlstream_control_unverified_total{reason}` (and
`rlstream_control_rejected_total{topic="control"}`) and logged, at most one
line per reason every 10 s with the count since the last one:

- `unsigned`: no signature header (a plain Kafka client);
- `bad_signature`: a signature that is not this deployment's (another token,
  a changed key or value, a malformed header);
- `no_key`: this service has no admin token, so it can verify nothing and
  applies no control record: the settings stay as configured (`staleness:`),
  and a warning at start says so;
- `replayed`: signed, but written at an earlier time (`at`, inside the signed
  value) than the value already applied for its key: a copy of an old record
  written again (the follower checks it; writers' clocks must agree to within
  the time between two changes of one setting).

Key setup: every service of a deployment (consumer, producers, `rlstream ctl`)
gets the same admin token (`RLSTREAM_ADMIN_TOKEN` sets producer.http.admin_token,
consumer.http.admin_token and cli.admin_token at once; a Kubernetes Secret,
`/etc/rlstream/rlstream.env`). A service with another token refuses the others'
changes as `bad_signature`. Rotating the token: restart every service with the
new one, then set each setting again (the records signed with the old token
no longer verify, so the configured values apply until then).

Signing proves who wrote a record, not who may write the topic: docs/operations.md
lists the Kafka ACLs a production cluster needs on every rlstream topic.
Any future writer of the control topic (an automatic controller, a replay tool)
calls `publish` with the service's key; nothing else writes it.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from rlstream.common.errors import RlstreamError

HEADER = "rlstream-signature"
VERSION = "v1"
_LABEL = b"rlstream control-topic signing key v1"


class UnverifiedRecord(RlstreamError):
    """A control record that must not be applied; `reason` is the metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def signing_key(admin_token: str | None) -> bytes | None:
    """The HMAC key of a deployment's control records, derived from its admin token (None: no token)."""
    if not admin_token:
        return None
    return hmac.new(admin_token.encode(), _LABEL, hashlib.sha256).digest()


def signature(key: bytes, record_key: bytes, value: bytes) -> bytes:
    """`v1:` + hex HMAC-SHA256 of the Kafka key and value, each length-prefixed (no two
    (key, value) pairs sign the same bytes)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (VERSION.encode(), record_key, value):
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return f"{VERSION}:{mac.hexdigest()}".encode()


def publish(producer, topic: str, record_key: bytes, value: bytes, key: bytes):
    """Send one signed record (kafka-python producer); returns its future."""
    return producer.send(topic, key=record_key, value=value, headers=[(HEADER, signature(key, record_key, value))])


def verify(key: bytes | None, record_key: bytes | None, value: bytes | None,
           headers: Iterable[tuple[str, bytes]] | None) -> None:
    """Return if the record's signature is this deployment's; else raise UnverifiedRecord."""
    if key is None:
        raise UnverifiedRecord("no_key", "this service has no admin token, so no control record can be verified")
    sent = [v for k, v in (headers or ()) if k == HEADER]
    if not sent:
        raise UnverifiedRecord("unsigned", f"no {HEADER} header (written by a plain Kafka client?)")
    want = signature(key, record_key or b"", value or b"")
    if len(sent) != 1 or not isinstance(sent[0], bytes) or not hmac.compare_digest(sent[0], want):
        raise UnverifiedRecord("bad_signature", f"the {HEADER} header does not match this deployment's admin "
                                                "token (another token, or a changed key or value)")
