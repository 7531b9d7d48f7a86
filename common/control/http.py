"""Every service's HTTP endpoint: /metrics, /healthz and the admin API.

- `GET /metrics`   Prometheus text exposition (common/metrics.py registry).
- `GET /healthz`   200 `{"status": "ok", ...}` while the service is live (its loop makes
  progress: common/control/liveness.py), else 503 with the reasons.
- `GET /readyz`    200 once the service is initialised and its broker reachable, else 503.
- `GET /admin/control`            current runtime settings (bearer token).
- `POST /admin/control` `{"key": "max_staleness", "value": 3}`  validate and
  write the change to `rlstream.control`; every service applies it at its next
  batch boundary. 401 without the right token (compared in constant time),
  400 for an invalid key or value; neither changes anything.

The admin API is off (404) when no token is configured (`*.http.admin_token`,
or env RLSTREAM_ADMIN_TOKEN: common/config.py ENV_ALIASES).

Hostile clients. The token is checked before a byte of the body is read; a
body must declare its Content-Length (411 otherwise) of at most
`MAX_BODY_BYTES` (413 otherwise); a response sent without reading the body
closes the connection. Every socket read times out after `client_timeout_s`
(10 s), a request (headers and body, however slowly trickled; the answer
included: a change waits up to 30 s for the broker) is cut after
`request_deadline_s` (60 s), and at most `max_connections` (64) are served at
once (more are closed at accept). So no client holds a server thread for
long, and /metrics keeps answering.
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from common import metrics
from common.errors import ConfigError

log = logging.getLogger(__name__)

_ADMIN = metrics.counter("rlstream_admin_requests_total", "Admin API requests by outcome", ["outcome"])
MAX_BODY_BYTES = 64 << 10
"""Largest admin request body ({"key", "value"} needs a few dozen bytes)."""


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once (more are closed at accept)."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            log.warning("http: %d connections open, refusing %s", self.max_connections, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ServiceHttp:
    """Serve /metrics, /healthz and (with a token) /admin/control on a thread.

    `health()` returns (ok, details). `get_control()` returns the current
    settings as a dict; `set_control(key, value)` validates and publishes one
    change (raising ConfigError for a bad value).
    """

    handler_base: type = None  # the request handler class (set below: _Handler); producer/agents.py serves its own
    max_body_bytes = MAX_BODY_BYTES

    def __init__(self, host: str, port: int, health: Callable[[], tuple[bool, dict]],
                 admin_token: str | None = None,
                 get_control: Callable[[], dict] | None = None,
                 set_control: Callable[[str, Any], Any] | None = None, *,
                 client_timeout_s: float = 10.0, request_deadline_s: float = 60.0, max_connections: int = 64,
                 ready: Callable[[], tuple[bool, dict]] | None = None):
        self.health, self.token = health, admin_token
        self.ready = ready or health  # (ready, details); without one, ready = live
        self.get_control, self.set_control = get_control, set_control
        self.request_deadline_s = request_deadline_s
        # `timeout`: socketserver's StreamRequestHandler puts it on the socket (every read and write)
        handler = type("Handler", (self.handler_base,), {"service": self, "timeout": client_timeout_s})
        self._server = _BoundedServer((host, port), handler, max_connections)
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ServiceHttp":
        self._thread.start()
        log.info("http: serving /metrics /healthz%s on %s",
                 " /admin/control" if self.token else "", self.url)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    close = stop

    def authorized(self, header: str | None) -> bool:
        if not self.token or not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].encode(), self.token.encode())


class _Handler(BaseHTTPRequestHandler):
    service: ServiceHttp
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request is noise
        log.debug("http %s - " + fmt, self.address_string(), *args)

    def handle_one_request(self):
        """One request, cut after `request_deadline_s` however slowly it trickles in."""
        timer = threading.Timer(self.service.request_deadline_s, self._cut)
        timer.daemon = True
        timer.start()
        try:
            super().handle_one_request()
        finally:
            timer.cancel()

    def _cut(self) -> None:
        log.warning("http: request from %s exceeded %.0f s; closing the connection", self.address_string(),
                    self.service.request_deadline_s)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj).encode())

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/healthz":
            ok, details = self.service.health()
            self._json(200 if ok else 503, {"status": "ok" if ok else "unhealthy", **details})
        elif path == "/readyz":
            ok, details = self.service.ready()
            self._json(200 if ok else 503, {"status": "ready" if ok else "not ready", **details})
        elif path == "/admin/control":
            if self._admin_guard():
                self._json(200, self.service.get_control() if self.service.get_control else {})
        else:
            self._json(404, {"error": f"no such path {path}"})

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        asked_close = self.close_connection  # what the client asked for (Connection: close / keep-alive)
        self.close_connection = True  # until the body is read: its bytes must not pass for a request
        if path != "/admin/control":
            self._json(404, {"error": f"no such path {path}"})
            return
        if not self._admin_guard():  # before a byte of the body is read
            return
        body = self._read_body()
        if body is None:
            return
        self.close_connection = asked_close
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict) or "key" not in req or "value" not in req:
                raise ConfigError('body must be {"key": ..., "value": ...}')
            applied = self.service.set_control(str(req["key"]), req["value"])
        except (ConfigError, ValueError) as e:
            _ADMIN.labels(outcome="invalid").inc()
            self._json(400, {"error": str(e)})
            return
        _ADMIN.labels(outcome="ok").inc()
        log.info("admin: set %s = %r (from %s)", req["key"], applied, self.address_string())
        self._json(200, {"key": req["key"], "value": applied})

    def _read_body(self) -> bytes | None:
        """The declared body, at most the service's `max_body_bytes`; None after answering why not."""
        declared = self.headers.get("Content-Length")
        if declared is None or self.headers.get("Transfer-Encoding"):
            self._json(411, {"error": "send the body with a Content-Length"})
            return None
        try:
            n = int(declared)
        except ValueError:
            n = -1
        if n < 0:
            self._json(400, {"error": f"bad Content-Length {declared[:40]!r}"})
            return None
        if n > self.service.max_body_bytes:
            self._json(413, {"error": f"body of {n} bytes; at most {self.service.max_body_bytes}"})
            return None
        body = self.rfile.read(n)  # a stall raises TimeoutError: handle_one_request closes the connection
        if len(body) < n:
            self.close_connection = True  # the client went away mid-body
            return None
        return body

    def _admin_guard(self) -> bool:
        if not self.service.token or self.service.set_control is None:
            self._json(404, {"error": "admin API disabled (no admin token configured)"})
            return False
        if not self.service.authorized(self.headers.get("Authorization")):
            _ADMIN.labels(outcome="unauthorized").inc()
            self._json(401, {"error": "missing or wrong bearer token"})
            return False
        return True


ServiceHttp.handler_base = _Handler


def start_service_http(settings, health, control_view, writer, by: str, ready=None) -> ServiceHttp:
    """The HTTP endpoint of a service (`settings`: config.HttpSettings).

    The admin token is `settings.admin_token` (the config loader applies the
    RLSTREAM_ADMIN_TOKEN alias); the admin API writes through `writer` (a
    control.plane.ControlPlaneWriter).
    """
    return ServiceHttp(settings.host, settings.port, health, settings.admin_token,
                       get_control=lambda: control_view().model_dump(),
                       set_control=lambda key, value: writer.set_control(key, value, by=by), ready=ready).start()

