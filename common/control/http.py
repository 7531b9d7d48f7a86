"""Every service's HTTP endpoint: /metrics, /healthz and the admin API.

- `GET /metrics`   Prometheus text exposition (common/metrics.py registry).
- `GET /healthz`   200 `{"status": "ok", ...}` while the service is live (its loop makes
  progress: common/control/liveness.py), else 503 with the reasons.
- `GET /readyz`    200 once the service is initialised and its broker reachable, else 503.
- `GET /admin/control`            current runtime settings (bearer token).
- `POST /admin/control` `{"key": "max_staleness", "value": 3}`  validate and
  write the change to `rlstream.control`; every service applies it at its next
  batch boundary (`"value": "auto"` hands max_staleness to the consumer's controller). 401 without the right token (compared in constant time),
  400 for an invalid key or value; neither changes anything.

The admin API is off (404) when no token is configured (`*.http.admin_token`,
or env RLSTREAM_ADMIN_TOKEN: common/config/load.py ENV_ALIASES).

Served by uvicorn + Starlette on a thread (common/http_server.py: the bounds on
header and body time, head and body size, connections, handlers at once and
JSON depth). The token is checked before a byte of the body is read. /healthz
runs on the event loop itself, never waiting for a thread, so it answers while
other clients trickle, flood or wait on the broker (a change waits up to 30 s
for it, on one of `max_requests` worker threads). /metrics (CPU work) and
/readyz (a broker connect, up to 1 s) run on anyio's default worker threads, a
pool apart from the admin API's.
"""
from __future__ import annotations

import hmac
import logging
from typing import Any, Callable

import anyio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlstream.common import metrics
from rlstream.common.errors import ConfigError
from rlstream.common.http_server import (
    BackgroundServer,
    HttpLimits,
    Refused,
    ThreadSlots,
    json_response,
    parse_json_object,
    read_body,
)

log = logging.getLogger(__name__)

_ADMIN = metrics.counter("rlstream_admin_requests_total", "Admin API requests by outcome", ["outcome"])
MAX_BODY_BYTES = 64 << 10
"""Largest admin request body ({"key", "value"} needs a few dozen bytes)."""
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class ServiceHttp:
    """Serve /metrics, /healthz and (with a token) /admin/control on a thread.

    `health()` returns (ok, details); it runs on the server's event loop, so it
    must be cheap and never block. `ready()` (default: `health`) likewise, on a
    worker thread (it may block briefly). `get_control()` returns the current settings
    as a dict; `set_control(key, value)` validates and publishes one change
    (raising ConfigError for a bad value). `limits`: HttpLimits fields
    (client_timeout_s, request_deadline_s, max_connections, ...).
    """

    def __init__(self, host: str, port: int, health: Callable[[], tuple[bool, dict]],
                 admin_token: str | None = None,
                 get_control: Callable[[], dict] | None = None,
                 set_control: Callable[[str, Any], Any] | None = None,
                 ready: Callable[[], tuple[bool, dict]] | None = None, **limits):
        self.health, self.token = health, admin_token
        self.ready = ready or health  # (ready, details); without one, ready = live
        self.get_control, self.set_control = get_control, set_control
        self.limits = HttpLimits(**{"max_body_bytes": MAX_BODY_BYTES, **limits})
        self.slots = ThreadSlots(self.limits.max_requests)
        app = Starlette(routes=[Route("/healthz", self._healthz), Route("/readyz", self._readyz), *self.routes(),
                                Route("/{path:path}", self._not_found, methods=ALL_METHODS)])
        self._server = BackgroundServer(app, host, port, self.limits, name=type(self).__name__)

    def routes(self) -> list[Route]:
        """The routes besides /healthz (a subclass serves its own: producer/rollout/agents/http.py)."""
        return [Route("/metrics", self._metrics),
                Route("/admin/control", self._admin, methods=["GET", "POST"])]

    @property
    def port(self) -> int:
        return self._server.address[1]

    @property
    def url(self) -> str:
        host, port = self._server.address
        return f"http://{host}:{port}"

    def start(self) -> "ServiceHttp":
        self._server.start()
        log.info("http: serving /metrics /healthz%s on %s",
                 " /admin/control" if self.token else "", self.url)
        return self

    def stop(self) -> None:
        self._server.stop()

    close = stop

    def authorized(self, header: str | None) -> bool:
        if not self.token or not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].encode(), self.token.encode())

    # -- handlers (on the event loop: blocking work goes through self.slots)

    async def _healthz(self, request: Request) -> Response:
        ok, details = self.health()
        return json_response(200 if ok else 503, {"status": "ok" if ok else "unhealthy", **details})

    async def _readyz(self, request: Request) -> Response:
        ok, details = await anyio.to_thread.run_sync(self.ready, abandon_on_cancel=True)
        return json_response(200 if ok else 503, {"status": "ready" if ok else "not ready", **details})

    async def _metrics(self, request: Request) -> Response:
        # on a worker thread: ~2 ms of CPU per scrape, so 300 scrapes at once on the loop would
        # hold /healthz for most of a second (measured: a probe took 1.4 s on a loaded machine)
        text = await anyio.to_thread.run_sync(metrics.exposition, abandon_on_cancel=True)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _not_found(self, request: Request) -> Response:
        return json_response(404, {"error": f"no such path {request.url.path}"}, close=_has_body(request))

    async def _admin(self, request: Request) -> Response:
        close = _has_body(request)  # answered before its body is read: close, its bytes are no request
        if not self.token or self.set_control is None:
            return json_response(404, {"error": "admin API disabled (no admin token configured)"}, close=close)
        if not self.authorized(request.headers.get("authorization")):  # before a byte of the body
            _ADMIN.labels(outcome="unauthorized").inc()
            return json_response(401, {"error": "missing or wrong bearer token"}, close=close)
        if request.method == "GET":
            return json_response(200, self.get_control() if self.get_control else {})
        try:
            return await self._set(request)
        except Refused as e:
            _ADMIN.labels(outcome="invalid").inc()
            return json_response(e.status, {"error": str(e)}, close=True)
        except (ConfigError, ValueError) as e:
            _ADMIN.labels(outcome="invalid").inc()
            return json_response(400, {"error": str(e)})

    async def _set(self, request: Request) -> Response:
        raw = await read_body(request, self.limits.max_body_bytes)
        if raw is None:  # the client went away mid-body
            return Response(status_code=400)
        req = parse_json_object(raw, self.limits.max_json_depth)
        if "key" not in req or "value" not in req:
            raise ConfigError('body must be {"key": ..., "value": ...}')
        applied = await self.slots.run(self.set_control, str(req["key"]), req["value"])
        _ADMIN.labels(outcome="ok").inc()
        log.info("admin: set %s = %r (from %s)", req["key"], applied, request.client)
        return json_response(200, {"key": req["key"], "value": applied})


def _has_body(request: Request) -> bool:
    return "content-length" in request.headers or "transfer-encoding" in request.headers


def start_service_http(settings, health, control_view, writer, by: str, ready=None,
                       status: Callable[[], dict] | None = None) -> ServiceHttp:
    """The HTTP endpoint of a service (`settings`: config.HttpSettings).

    The admin token is `settings.admin_token` (the config loader applies the
    RLSTREAM_ADMIN_TOKEN alias); the admin API writes through `writer` (a
    control.plane.ControlPlaneWriter, as an operator's change); `status`: more
    for GET /admin/control besides the settings (the consumer's controller).
    """
    return ServiceHttp(settings.host, settings.port, health, settings.admin_token,
                       get_control=lambda: {**control_view().model_dump(), **(status() if status else {})},
                       set_control=lambda key, value: writer.set_by_operator(key, value, by=by), ready=ready).start()

