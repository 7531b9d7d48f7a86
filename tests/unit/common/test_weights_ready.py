"""`WeightsReady` on the policy topic (common/control/messages.py): one kind-tagged message for
both transports, each complete for its transport."""
from __future__ import annotations

import pydantic
import pytest

from rlstream.common.control.messages import DurableCopy, WeightsReady, parse_policy_message

SHA, DIGEST = "0" * 64, "ab" * 32
LINK = {"transport": "collective", "digest": DIGEST, "endpoint": "h:1", "backend": "rlstream_gloo"}


def test_a_file_message_names_the_version_as_its_durable_copy():
    msg = WeightsReady(version=3, transport="file", uri="file:///w/v3", sha256=SHA, bytes=10)
    assert parse_policy_message(msg.model_dump_json().encode()) == msg
    assert msg.durable_copy() == DurableCopy(3, "file:///w/v3", SHA, 10)


def test_collective_names_digest_endpoint_backend_and_the_newest_durable_copy():
    msg = WeightsReady(version=12, transport="collective", digest=DIGEST, endpoint="10.0.0.5:29600", backend="nccl",
                       durable_version=10, durable_uri="file:///w/v10", durable_sha256=SHA, durable_bytes=99)
    assert parse_policy_message(msg.model_dump_json().encode()) == msg
    assert msg.durable_copy() == DurableCopy(10, "file:///w/v10", SHA, 99)
    bare = WeightsReady(version=1, **LINK)
    assert bare.durable_copy() is None and bare.uri is None


@pytest.mark.parametrize("fields,words", [
    ({"uri": "file:///x", "sha256": SHA, "bytes": 1}, "transport"),
    ({"transport": "file"}, "uri, sha256 and bytes"),
    ({"transport": "collective", "digest": DIGEST, "backend": "nccl"}, "needs an endpoint and a backend"),
    ({"transport": "collective", "digest": DIGEST, "endpoint": "h:1"}, "needs an endpoint and a backend"),
    ({**LINK, "backend": "carrier pigeon"}, "backend"),
    ({**LINK, "digest": "XYZ"}, "digest"),
    ({**LINK, "endpoint": "no port"}, "endpoint"),
    ({**LINK, "durable_version": 1}, "go together"),
    ({**LINK, "durable_version": 9, "durable_uri": "file:///x", "durable_sha256": SHA, "durable_bytes": 1},
     "newer than version"),
    ({"transport": "carrier pigeon", "uri": "file:///x", "sha256": SHA, "bytes": 1}, "transport"),
])
def test_incomplete_or_contradictory_messages_are_refused(fields, words):
    with pytest.raises(pydantic.ValidationError, match=words):
        WeightsReady(version=5, **fields)


def test_a_collective_announcement_needs_no_digest():
    """The link's finish carries the digest a producer checks; the announcement names the endpoint."""
    assert WeightsReady(version=3, transport="collective", endpoint="h:1", backend="nccl").digest is None
