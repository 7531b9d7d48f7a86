"""Control values: validation, encoding; the admin HTTP API's auth."""
import json
import urllib.error
import urllib.request

import pytest

from rlstream.common.control.messages import encode_control, parse_control_text, parse_control_value
from rlstream.common.errors import ConfigError
from rlstream.common.control.http import ServiceHttp


@pytest.mark.parametrize("key,raw,want", [
    ("max_staleness", 4, 4), ("max_staleness", 0, 0), ("mode", "reweight", "reweight"),
    ("decay", 0.9, 0.9), ("decay", 1, 1.0), ("paused", True, True), ("paused", False, False),
])
def test_valid_values(key, raw, want):
    got = parse_control_value(key, raw)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("key,text,want", [
    ("max_staleness", "4", 4), ("max_staleness", " 0 ", 0), ("mode", "Reweight", "reweight"),
    ("decay", "0.9", 0.9), ("paused", "true", True), ("paused", "no", False),
])
def test_valid_command_line_text(key, text, want):
    assert parse_control_text(key, text) == want


@pytest.mark.parametrize("key,raw", [
    ("max_staleness", -1), ("max_staleness", 10_000), ("mode", "sometimes"), ("decay", 0), ("decay", 1.5),
    ("decay", float("nan")), ("nokey", 1),
    # strict types: JSON true is not max_staleness 1, nor 2.0 / "2" the integer 2, nor 1 / "true" paused
    ("max_staleness", True), ("max_staleness", False), ("max_staleness", 2.0), ("max_staleness", "2"),
    ("max_staleness", None), ("decay", True), ("decay", "0.5"), ("paused", 1), ("paused", 0),
    ("paused", "true"), ("mode", 1), ("mode", ["drop"]),
])
def test_invalid_values_refused(key, raw):
    with pytest.raises(ConfigError) as e:
        parse_control_value(key, raw)
    assert key in str(e.value)


@pytest.mark.parametrize("key,text", [
    ("max_staleness", "-1"), ("max_staleness", "two"), ("max_staleness", "1.5"), ("mode", "sometimes"),
    ("decay", "0"), ("decay", "1.5"), ("paused", "maybe"), ("nokey", "1"),
])
def test_invalid_command_line_text_refused(key, text):
    with pytest.raises(ConfigError) as e:
        parse_control_text(key, text)
    assert key in str(e.value)


def test_encode_control_is_json_with_key():
    k, v = encode_control("max_staleness", 3, by="test")
    assert k == b"max_staleness" and json.loads(v)["value"] == 3
    with pytest.raises(ConfigError):
        encode_control("max_staleness", True, by="test")


@pytest.fixture
def http():
    state = {"max_staleness": 2}

    def set_control(key, value):
        state[key] = parse_control_value(key, value)
        return state[key]

    s = ServiceHttp("127.0.0.1", 0, lambda: (True, {"version": 1}), admin_token="tok",
                    get_control=lambda: dict(state), set_control=set_control).start()
    yield s, state
    s.stop()


def _req(url, body=None, token=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_admin_requires_token_and_changes_nothing_without_it(http):
    s, state = http
    assert _req(s.url + "/admin/control", {"key": "max_staleness", "value": 9})[0] == 401
    assert _req(s.url + "/admin/control", {"key": "max_staleness", "value": 9}, token="wrong")[0] == 401
    assert state["max_staleness"] == 2
    assert _req(s.url + "/admin/control", {"key": "max_staleness", "value": 9}, token="tok") == (200, {"key": "max_staleness", "value": 9})
    assert state["max_staleness"] == 9


def test_admin_rejects_invalid_value(http):
    s, state = http
    code, body = _req(s.url + "/admin/control", {"key": "max_staleness", "value": -3}, token="tok")
    assert code == 400 and "max_staleness" in body["error"] and state["max_staleness"] == 2


def test_health_and_metrics(http):
    s, _ = http
    assert _req(s.url + "/healthz") == (200, {"status": "ok", "version": 1})
    with urllib.request.urlopen(s.url + "/metrics", timeout=5) as r:
        assert b"rlstream_" in r.read()


def test_ctl_cli_get_set_and_refusals(http, capsys):
    from rlstream.cli import main

    s, state = http
    assert main(["ctl", "set", "max_staleness", "5", "--url", s.url, "--token", "tok"]) == 0
    assert json.loads(capsys.readouterr().out) == {"key": "max_staleness", "value": 5}
    assert state["max_staleness"] == 5
    assert main(["ctl", "get", "--url", s.url, "--token", "tok"]) == 0
    assert json.loads(capsys.readouterr().out) == {"max_staleness": 5}
    # a bad value is refused locally, before any request
    assert main(["ctl", "set", "max_staleness", "-2", "--url", s.url, "--token", "tok"]) == 2
    assert "max_staleness" in capsys.readouterr().err and state["max_staleness"] == 5
    # a wrong token is refused by the service, with a hint
    assert main(["ctl", "set", "max_staleness", "7", "--url", s.url, "--token", "nope"]) == 2
    assert "401" in capsys.readouterr().err and state["max_staleness"] == 5


def test_ctl_takes_url_and_token_from_the_declared_environment_and_flags_win(http, capsys, monkeypatch):
    from rlstream.cli import main

    s, state = http
    monkeypatch.setenv("RLSTREAM_ADMIN_URL", s.url)
    monkeypatch.setenv("RLSTREAM_ADMIN_TOKEN", "tok")
    assert main(["ctl", "set", "max_staleness", "6"]) == 0
    assert json.loads(capsys.readouterr().out) == {"key": "max_staleness", "value": 6}
    assert state["max_staleness"] == 6
    assert main(["ctl", "set", "max_staleness", "8", "--token", "nope"]) == 2  # the flag wins over the env
    assert "401" in capsys.readouterr().err and state["max_staleness"] == 6
    monkeypatch.setenv("RLSTREAM_ADMIN_URL", "http://127.0.0.1:9")  # nothing listens there
    assert main(["ctl", "get", "--url", s.url]) == 0
    assert json.loads(capsys.readouterr().out) == {"max_staleness": 6}
    assert main(["ctl", "get"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_admin_api_errors_carry_the_status():
    from rlstream.common.control.ctl import _request
    from rlstream.common.errors import AdminApiError

    with pytest.raises(AdminApiError) as e:
        _request("http://127.0.0.1:9", None)
    assert e.value.status is None


def test_dry_run_prints_the_resolved_declared_variables_masked(capsys, monkeypatch):
    import yaml

    from rlstream.cli import main

    monkeypatch.setenv("RLSTREAM_ADMIN_TOKEN", "s3cret-token")
    monkeypatch.setenv("RLSTREAM_LOG_LEVEL", "debug")
    assert main(["producer", "--dry-run"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert "s3cret-token" not in out and data["producer"]["http"]["admin_token"] == "***"
    assert data["cli"]["log_level"] == "DEBUG"
    assert main(["--log-level", "error", "consumer", "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["cli"]["log_level"] == "ERROR"
    assert main(["--log-level", "chatty", "consumer", "--dry-run"]) == 2
    assert "cli.log_level" in capsys.readouterr().err


def test_policy_messages_are_tagged_by_kind():
    import pydantic

    from rlstream.common.control.messages import TrainerProgress, WeightsReady, parse_policy_message

    ready = WeightsReady(version=3, transport="file", uri="file:///w/v3", sha256="0" * 64, bytes=10)
    progress = TrainerProgress(trainer_version=3, read_offsets={0: 30}, held_records=4,
                               groups_per_batch=2, group_size=4)
    assert parse_policy_message(ready.model_dump_json().encode()) == ready
    back = parse_policy_message(progress.model_dump_json().encode())
    assert isinstance(back, TrainerProgress) and back.read_offsets == {0: 30} and back.groups_per_batch == 2
    assert back.filtered_share == 0.0  # a trainer without dynamic sampling (or an older one) sends none
    shared = TrainerProgress(trainer_version=3, groups_per_batch=2, group_size=4, filtered_share=0.375)
    assert parse_policy_message(shared.model_dump_json().encode()).filtered_share == 0.375
    with pytest.raises(pydantic.ValidationError):
        parse_policy_message(b'{"kind": "trainer_progress", "trainer_version": 1, "groups_per_batch": 2, '
                             b'"group_size": 4, "filtered_share": 1.5}')
    for bad in (b'{"version": 3, "uri": "file:///x", "sha256": "' + b"0" * 64 + b'", "bytes": 1}',  # no kind
                b'{"kind": "trainer_progress", "trainer_version": 1, "groups_per_batch": 0, "group_size": 4}',
                b'{"kind": "weights_ready", "version": 1, "transport": "file", "uri": "", "sha256": "x", "bytes": 1}'):
        with pytest.raises(pydantic.ValidationError):
            parse_policy_message(bad)


def test_follower_keeps_the_newest_version_and_the_latest_progress():
    from rlstream.common.config import ControlSettings
    from rlstream.common.control.messages import TrainerProgress, WeightsReady
    from rlstream.common.control.plane import ControlFollower, ControlView

    f = ControlFollower.__new__(ControlFollower)  # no Kafka: exercise the apply rule alone
    f.view = ControlView(state=ControlSettings())
    v2 = WeightsReady(version=2, transport="file", uri="file:///w/v2", sha256="0" * 64, bytes=1)
    v1 = WeightsReady(version=1, transport="file", uri="file:///w/v1", sha256="0" * 64, bytes=1)
    p5 = TrainerProgress(trainer_version=5, groups_per_batch=2, group_size=4)
    p4 = TrainerProgress(trainer_version=4, groups_per_batch=2, group_size=4)
    assert f._apply_policy(v2) is v2 and f._apply_policy(v1) is None and f.view.weights is v2
    assert f._apply_policy(p5) is p5 and f._apply_policy(p4) is p4 and f.view.progress is p4  # log order wins


# ---------------------------------------------------------------- hostile HTTP clients (raw sockets)

def _server(**limits):
    calls = []
    s = ServiceHttp("127.0.0.1", 0, lambda: (True, {}), admin_token="tok", get_control=dict,
                    set_control=lambda k, v: calls.append((k, v)) or v, **limits).start()
    return s, calls


@pytest.fixture
def strict_http():
    """A server with short client timeouts, so the slow-client cases take a second, not minutes."""
    s, calls = _server(client_timeout_s=1.0, request_deadline_s=2.5, max_connections=4)
    yield s, calls
    s.stop()


@pytest.fixture
def patient_http():
    """Timeouts far beyond the test's own 5 s wait: an answer within it was not a timeout."""
    s, calls = _server(client_timeout_s=60.0, request_deadline_s=120.0)
    yield s, calls
    s.stop()


def _raw(s, head: bytes, body: bytes = b"", wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send `head` (+ `body`), then read until the server closes: (everything it sent, seconds)."""
    import socket
    import time

    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", s.port), timeout=wait_s) as c:
        c.sendall(head + body)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    return out, time.monotonic() - t0


def test_admin_refuses_a_huge_body_before_reading_it(patient_http):
    """The unauthenticated 1 GB POST of the issue: 401 at once, connection closed, body never read
    (the server's own timeouts are 60 s: `_raw` would time out after 5 s if it waited for the body)."""
    s, calls = patient_http
    head = b"POST /admin/control HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
    out, secs = _raw(s, head)
    assert out.startswith(b"HTTP/1.1 401") and b"connection: close" in out.lower() and secs < 5
    out, secs = _raw(s, head.replace(b"Host: x", b"Host: x\r\nAuthorization: Bearer tok"))
    assert out.startswith(b"HTTP/1.1 413") and secs < 5
    auth = b"POST /admin/control HTTP/1.1\r\nAuthorization: Bearer tok\r\n"
    assert _raw(s, auth + b"\r\n")[0].startswith(b"HTTP/1.1 411")
    assert _raw(s, auth + b"Content-Length: -5\r\n\r\n")[0].startswith(b"HTTP/1.1 400")
    assert _raw(s, auth + b"Transfer-Encoding: chunked\r\n\r\n")[0].startswith(b"HTTP/1.1 411")
    assert calls == []
    body = json.dumps({"key": "max_staleness", "value": 3}).encode()
    out, _ = _raw(s, auth + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body), body)
    assert out.startswith(b"HTTP/1.1 200") and calls == [("max_staleness", 3)]


def test_slow_clients_are_timed_out_and_others_are_served_meanwhile(strict_http):
    import socket
    import threading
    import time

    s, calls = strict_http
    results = {}

    def stall(name, head, trickle=b""):
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(head)
            try:
                for b in trickle:  # one byte every 0.5 s: each read is in time, the request is not
                    c.sendall(bytes([b]))
                    time.sleep(0.5)
                while c.recv(65536):
                    pass
            except OSError:
                pass
        results[name] = time.monotonic() - t0

    auth = b"POST /admin/control HTTP/1.1\r\nAuthorization: Bearer tok\r\nContent-Length: 100\r\n\r\n"
    threads = [threading.Thread(target=stall, args=("silent", b"")),                   # connects, says nothing
               threading.Thread(target=stall, args=("mid_body", auth + b'{"key": ')),   # stops mid-body
               threading.Thread(target=stall, args=("trickle", b"GET /metrics HTTP/1.1\r\n", b"X-Slow: " + b"a" * 40))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    with urllib.request.urlopen(s.url + "/healthz", timeout=5) as r:  # served while three clients stall
        assert r.status == 200
    for t in threads:
        t.join(15)
    assert results["silent"] < 4.0 and results["mid_body"] < 4.0, results  # client_timeout_s = 1
    assert 2.0 < results["trickle"] < 8.0, results  # request_deadline_s = 2.5; the trickle alone takes 24 s
    assert calls == []


def test_connections_beyond_the_limit_get_503_with_retry_after(strict_http):
    """On c99ceb0 the connection was closed without an answer (the client saw an empty reply)."""
    import socket
    import time

    from rlstream.common import metrics

    s, _ = strict_http
    refused0 = metrics.value("rlstream_http_refused_total", reason="connections") or 0
    held = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := extra.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1" in head, answer
        assert json.loads(body) == {"error": "too many connections open; retry shortly"}
        assert metrics.value("rlstream_http_refused_total", reason="connections") - refused0 == 1
    finally:
        for c in held:
            c.close()
    time.sleep(1.5)  # the held ones time out and free their slots
    with urllib.request.urlopen(s.url + "/healthz", timeout=5) as r:
        assert r.status == 200


# ---------------------------------------------------------------- signed control records

def test_control_records_verify_only_with_the_deployments_key_and_unchanged():
    from rlstream.common.control.signing import (
        HEADER,
        UnverifiedRecord,
        publish,
        signature,
        signing_key,
        verify,
    )

    key, other = signing_key("tok"), signing_key("another")
    assert signing_key(None) is None and signing_key("") is None and key != other and b"tok" not in key
    k, v = encode_control("paused", True, by="admin")
    sent = []

    class Producer:
        def send(self, topic, key, value, headers):
            sent.append((topic, key, value, headers))
            return "future"

    assert publish(Producer(), "t.control", k, v, key) == "future"
    (_, k2, v2, headers), = sent
    verify(key, k2, v2, headers)  # passes
    cases = {"no_key": (None, k, v, headers), "unsigned": (key, k, v, []),
             "bad_signature": (other, k, v, headers)}
    cases["bad_signature "] = (key, b"max_staleness", v, headers)  # the signature moved to another key
    cases["bad_signature  "] = (key, k, v.replace(b"true", b"false"), headers)  # the value changed
    cases["bad_signature   "] = (key, k, v, [(HEADER, b"v1:" + b"0" * 64)])
    cases["bad_signature    "] = (key, k, v, headers * 2)  # two signatures: refused, not "any of them"
    for reason, args in cases.items():
        with pytest.raises(UnverifiedRecord) as e:
            verify(*args)
        assert e.value.reason == reason.strip()
    assert signature(key, b"ab", b"c") != signature(key, b"a", b"bc")  # length-prefixed parts
