"""uvicorn + Starlette on a thread of a synchronous service, bounded against hostile clients.

Every rlstream HTTP endpoint (/metrics, /healthz and the admin API:
common/control/http.py; the agent endpoint: producer/rollout/agents/http.py) is a
Starlette app served by `BackgroundServer`: uvicorn with its own event loop on a
daemon thread, the listening socket bound (backlog 2048) before `start()` so
the port is known at once and early clients queue instead of being refused.

One event loop serves every connection: a slow or silent client costs a
socket and a few hundred bytes, never a thread, so /healthz (an async handler
that never waits on a thread) answers whatever the other clients do. The
bounds, all in `HttpLimits` (docs/operations.md "HTTP endpoints"):

- client_timeout_s: the longest silence while a request is being sent (head or
  body) and between keep-alive requests; the connection is closed.
- head_timeout_s: the request line and headers, from their first byte, however
  slowly they trickle in (uvicorn has no header timeout of its own: its
  keep-alive timer is cancelled by every byte, so one byte a second holds a
  connection for ever; `_GuardedProtocol` adds this and the next timers).
- body_timeout_s: the body, from the end of the headers.
- request_deadline_s: a request from its first byte to the end of its answer
  (the agent endpoint's is its call timeout plus 30 s).
- max_head_bytes: the request line and headers (httptools sets no limit).
- max_connections: connections open at once; a connection beyond them is
  answered at accept with 503 and Retry-After (without reading its request:
  the answer costs no handler) and closed.
- max_requests: handlers running at once on threads (blocking work: the
  admin API's broker write, an agent's chat call); more get 503 at once, with
  Retry-After, instead of queueing behind them.
- max_body_bytes (declared Content-Length required: 411; more: 413) and
  max_json_depth (400 before json.loads can recurse): see `read_body` and
  `parse_json_object`.
Each refusal is counted in rlstream_http_refused_total{reason}.
"""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

import anyio
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rlstream.common import metrics

log = logging.getLogger(__name__)

REFUSED = metrics.counter("rlstream_http_refused_total",
                          "HTTP requests or connections refused by a bound, by reason", ["reason"])


@dataclass(frozen=True)
class HttpLimits:
    """The bounds of one HTTP endpoint (module docstring)."""

    client_timeout_s: float = 10.0
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    request_deadline_s: float = 60.0
    max_connections: int = 1024
    max_requests: int = 64
    max_head_bytes: int = 16 << 10
    max_body_bytes: int = 64 << 10
    max_json_depth: int = 64
    backlog: int = 2048


# ---------------------------------------------------------------- connection guard

class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the connection cap, the timers and the head size limit.

    httptools rather than h11: h11 answers an HTTP/1.1 request without a Host
    header with a bare 400 before the app can say what is wrong (e.g. 411)."""

    limits: HttpLimits  # set on the per-server subclass (BackgroundServer)
    _timers: dict
    _head_bytes = 0
    _head_too_large = False
    _warned_at = float("-inf")

    def connection_made(self, transport) -> None:
        self._timers = {}
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # for connection_lost
            REFUSED.labels(reason="connections").inc()
            if self.loop.time() - type(self)._warned_at > 10.0:  # a flood logs a line per 10 s, not per connection
                type(self)._warned_at = self.loop.time()
                log.warning("http: %d connections open; answering new ones 503 at accept and closing them "
                            "(counted in rlstream_http_refused_total)", len(self.connections))
            # the answer, then FIN now and close later: closing a socket whose request is still
            # unread sends a reset, which the client would see instead of the answer
            transport.write(_OVER_CAP)
            transport.write_eof()
            self.loop.call_later(1.0, transport.abort)
            return
        super().connection_made(transport)
        self._arm("idle", self.limits.client_timeout_s)

    def connection_lost(self, exc) -> None:
        for timer in self._timers.values():
            timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._arm("idle", self.limits.client_timeout_s)
        super().data_received(data)

    # -- httptools callbacks, in the order of a request

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._arm("deadline", self.limits.request_deadline_s)
        self._arm("head", self.limits.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm("head")
        self._arm("body", self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm("body")  # the whole request is in: the client may be silent while the app works
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._disarm("deadline")
        self._disarm("body")  # answered without reading the body (then the connection closes)
        super().on_response_complete()  # arms uvicorn's keep-alive timer (client_timeout_s)

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:  # raised from on_header: httptools reports it as a parser error
            REFUSED.labels(reason="head_too_large").inc()
            msg = f"request line and headers over {self.limits.max_head_bytes} bytes"
        super().send_400_response(msg)

    # -- the guard

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_head_bytes:
            self._head_too_large = True
            raise ValueError("head too large")

    def _arm(self, why: str, seconds: float) -> None:
        self._disarm(why)
        self._timers[why] = self.loop.call_later(seconds, self._cut, why)

    def _disarm(self, why: str) -> None:
        timer = self._timers.pop(why, None)
        if timer is not None:
            timer.cancel()

    def _waiting_on_client(self) -> bool:
        """False while the whole request is in (the app is working: silence is the client's
        right) or reading is paused (the app has not yet taken the body buffered so far)."""
        if self.flow is not None and self.flow.read_paused:
            return False
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def _cut(self, why: str) -> None:
        self._timers.pop(why, None)
        if self.transport is None or self.transport.is_closing():
            return
        if why == "idle" and not self._waiting_on_client():
            return
        REFUSED.labels(reason=f"{why}_timeout").inc()
        log.info("http: closing the connection of %s: %s", self.client, _CUT_WHY[why].format(l=self.limits))
        self.transport.close()


_OVER_CAP_BODY = b'{"error": "too many connections open; retry shortly"}'
_OVER_CAP = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
             b"Content-Length: " + str(len(_OVER_CAP_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _OVER_CAP_BODY)
"""What a connection beyond max_connections gets at accept, before its request is read."""

_CUT_WHY = {
    "idle": "silent for {l.client_timeout_s:g} s mid-request",
    "head": "request line and headers not in within {l.head_timeout_s:g} s",
    "body": "body not in within {l.body_timeout_s:g} s of the headers",
    "deadline": "request not answered within {l.request_deadline_s:g} s",
}


# ---------------------------------------------------------------- server thread

class BackgroundServer:
    """uvicorn serving `app` on a daemon thread; `stop()` ends it within a few seconds."""

    def __init__(self, app, host: str, port: int, limits: HttpLimits, name: str = "http"):
        self.limits = limits
        self.sock = socket.create_server((host, port), backlog=limits.backlog)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]  # kept after stop(), for logs
        protocol = type("GuardedProtocol", (_GuardedProtocol,), {"limits": limits})
        config = uvicorn.Config(app, http=protocol, ws="none", lifespan="off", loop="asyncio",
                                log_config=None, access_log=False, server_header=False, backlog=limits.backlog,
                                timeout_keep_alive=limits.client_timeout_s, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()
        for _ in range(200):  # the socket already queues clients; wait only to surface a failed start
            if self._server.started or not self._thread.is_alive():
                break
            self._thread.join(0.05)
        if not self._server.started:
            raise RuntimeError(f"http: the server on {self.address} did not start (see the log)")

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(10)
        self.sock.close()


# ---------------------------------------------------------------- request helpers

class Refused(Exception):
    """A request refused by a bound or as malformed: `status`, a message naming what is wrong."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.reason = status, reason


def closing(response: Response) -> Response:
    """`response` with Connection: close (sent before the body was read: its bytes must not pass
    for the next request)."""
    response.headers["Connection"] = "close"
    return response


def json_response(status: int, obj: Any, *, close: bool = False) -> Response:
    response = JSONResponse(obj, status_code=status)
    if status == 503:
        response.headers["Retry-After"] = "1"
    return closing(response) if close else response


async def read_body(request: Request, max_bytes: int) -> bytes | None:
    """The declared body, at most `max_bytes`; None when the client went away mid-body.

    Raises Refused before reading a byte: 411 without a Content-Length (or with a
    Transfer-Encoding), 413 beyond `max_bytes`. A stalled body is cut by the
    connection's idle timer (the stream then ends as a disconnect)."""
    declared = request.headers.get("content-length")
    if declared is None or "transfer-encoding" in request.headers:
        raise _refuse(411, "send the body with a Content-Length", "no_length")
    n = int(declared)  # httptools has checked it is a number
    if n > max_bytes:
        raise _refuse(413, f"body of {n} bytes; at most {max_bytes}", "body_too_large")
    chunks = []
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(chunks)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one to the end: every quote starts a match, so the search
never restarts inside a string (linear, whatever the body)."""
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (brackets inside strings ignored).
    C-speed filtering, then one pass over the brackets alone."""
    depth = deepest = 0
    for b in _STRING.sub(b"", raw).translate(None, _NOT_BRACKET):
        depth += 1 if b in (0x5B, 0x7B) else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json_object(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object; Refused (400) when it is not one or nests deeper than `max_depth`
    (checked first: json.loads recurses once per level, and 60,000 levels raise RecursionError)."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise _refuse(400, f"the body nests {depth} levels deep; at most {max_depth}", "json_depth")
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as e:
        raise _refuse(400, f"the body is not JSON: {e}"[:300], "bad_json") from e
    if not isinstance(body, dict):
        raise _refuse(400, "the body must be a JSON object", "bad_json")
    return body


def _refuse(status: int, message: str, reason: str) -> Refused:
    REFUSED.labels(reason=reason).inc()
    return Refused(status, message, reason)


class ThreadSlots:
    """At most `n` blocking handlers at once, each on a worker thread; beyond, 503 at once."""

    def __init__(self, n: int):
        self.n = n
        self._limiter: anyio.CapacityLimiter | None = None  # made on the server's loop

    async def run(self, fn: Callable, *args):
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.n)
        if self._limiter.available_tokens < 1:
            raise _refuse(503, f"{self.n} requests are being handled; retry shortly", "busy")
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter, abandon_on_cancel=True)
