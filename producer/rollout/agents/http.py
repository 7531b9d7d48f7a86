"""The black-box agents' HTTP API (producer.agent_endpoint; docs/multi-turn.md has the
reference). It is the admin endpoint's server (common/control/http.py: uvicorn +
Starlette, bounded by common/http_server.py) with other routes: the token checked
before a byte of the body is read, a declared Content-Length of at most
`max_body_bytes`, JSON at most `max_json_depth` deep, head and body timeouts, a
per-request deadline (the call timeout plus 30 s), at most `max_connections`
connections. Requests run on producer/rollout/agents/driver.py's `AgentEpisodes` (engine
thread; producer/rollout/build.py gives it this server to stop and close); bodies are
producer/rollout/agents/openai.py's. This module only routes, reads and answers.

Calls hold no thread. A command is queued for the engine's thread and its
answer awaited on the event loop (a chat call waits for its turn to be
generated: up to `call_timeout_s`), so a thousand waiting calls cost a thousand
futures, not a thousand threads. At most `max_calls` wait at once: the next one
is answered at once with 503, `Retry-After: 1` and the OpenAI error type
`unavailable` ("N calls are waiting on the engine"), counted in
`rlstream_http_refused_total{reason="calls"}` and
`rlstream_producer_agent_refused_total{kind="unavailable"}`; nothing of it
reached the engine, so the agent retries it as it was.

    POST /v1/groups                                 open a group of G episodes
    POST /v1/episodes/{id}/chat/completions         one model turn (OpenAI chat.completions)
    POST /v1/episodes/{id}/reward                   close and publish
    GET  /v1/episodes/{id}                          the episode's state and messages
    GET  /v1/models                                 the served model (OpenAI clients ask)
    GET  /healthz                                   200 while the server runs (no token)
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import re

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlstream.common.config import AgentEndpointSettings
from rlstream.common.control.http import ServiceHttp
from rlstream.common.http_server import REFUSED, Refused, json_response, parse_json_object, read_body
from rlstream.producer import telemetry
from rlstream.producer.rollout.agents.driver import AgentEpisodes
from rlstream.producer.rollout.agents.openai import error_body

log = logging.getLogger("rlstream.producer.agents")

_EPISODE = re.compile(r"^/v1/episodes/([0-9a-f]{1,64})(/chat/completions|/reward)?$")
_QUICK_S = 30.0
"""How long a command other than a chat call may wait for the engine's thread (one engine step)."""
_ERROR_TYPE = {401: "unauthorized", 404: "not_found", 503: "unavailable"}
"""The OpenAI error `type` of a refusal by status (any other: invalid_request_error)."""


class AgentHttp(ServiceHttp):
    """The agent endpoint on its own port; `agents.base_url` is set to its address."""

    def __init__(self, settings: AgentEndpointSettings, agents: AgentEpisodes):
        self.settings, self.agents = settings, agents
        super().__init__(settings.host, settings.port, lambda: (True, {}), admin_token=settings.token,
                         client_timeout_s=10.0, request_deadline_s=settings.call_timeout_s + 30.0,
                         max_connections=settings.max_connections, max_body_bytes=settings.max_body_bytes)
        agents.base_url = self.url
        self.waiting = 0
        """Calls waiting on the engine now (changed on the event loop only)."""

    def routes(self) -> list[Route]:
        return [Route("/{path:path}", self._route, methods=["GET", "POST"])]

    def start(self) -> "AgentHttp":
        self._server.start()
        log.info("agent endpoint: serving /v1/groups and /v1/episodes/{id}/chat/completions on %s", self.url)
        return self

    async def _route(self, request: Request) -> Response:
        try:
            if request.method == "GET":
                status, body = await self._get(request)
            else:
                status, body = await self._post(request)
        except Refused as e:
            kind = _ERROR_TYPE.get(e.status, "invalid_request_error")
            telemetry.AGENT_REFUSED.labels(kind=kind).inc()
            return json_response(e.status, error_body(str(e), kind), close=request.method != "GET")
        except ValueError as e:  # a request field producer/rollout/agents/openai.py refused
            telemetry.AGENT_REFUSED.labels(kind="invalid_request_error").inc()
            return json_response(400, error_body(str(e)[:300], "invalid_request_error"))
        return json_response(status, body)

    async def _get(self, request: Request) -> tuple[int, dict]:
        path = request.url.path
        self._guard(request)
        if path == "/v1/models":
            name = self.agents.engine.model_dir.name
            return 200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rlstream"}]}
        m = _EPISODE.match(path)
        if m is None or m.group(2):
            raise Refused(404, f"no such path {path}", "not_found")
        return await self._call("describe", m.group(1), {}, _QUICK_S)

    async def _post(self, request: Request) -> tuple[int, dict]:
        kind, eid, wait = self._command(request.url.path)
        self._guard(request)  # before a byte of the body is read
        raw = await read_body(request, self.limits.max_body_bytes)
        if raw is None:  # the client went away mid-body
            return 400, error_body("the body did not arrive", "invalid_request_error")
        body = parse_json_object(raw, self.limits.max_json_depth)
        return await self._call(kind, eid, body, wait)

    async def _call(self, kind: str, eid: str | None, body: dict, timeout_s: float) -> tuple[int, dict]:
        """Queue a command for the engine's thread and await its answer on the event loop; 503 at once
        when `max_calls` are waiting already."""
        if self.waiting >= self.settings.max_calls:
            REFUSED.labels(reason="calls").inc()
            raise Refused(503, f"{self.waiting} calls are waiting on the engine (producer.agent_endpoint."
                               "max_calls); retry shortly", "calls")
        self.waiting += 1
        try:
            fut = self.agents.submit(kind, eid, body)
            return await self._answer(fut, timeout_s)
        finally:
            self.waiting -= 1

    async def _answer(self, fut: cf.Future, timeout_s: float) -> tuple[int, dict]:
        """`fut`'s answer, awaited on the event loop (no thread held); 504 after `timeout_s`,
        503 when the producer shuts down before answering it."""
        waiting, loop = asyncio.wrap_future(fut), asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait({waiting}, timeout=min(1.0, left))  # in slices: see `closed`
            if done:
                return waiting.result()
            if self.agents.closed and not fut.done():  # queued as the producer shut down: never run
                return 503, error_body("the producer is shutting down", "unavailable")
        return 504, error_body(f"no answer within {timeout_s:.0f} s (a generating turn is still recorded: the "
                               "episode's history holds it; GET the episode for its messages)", "timeout")

    def _command(self, path: str) -> tuple[str, str | None, float]:
        """(kind, episode id, seconds to wait) of a POST path; Refused (404) for any other."""
        if path == "/v1/groups":
            return "open", None, _QUICK_S
        m = _EPISODE.match(path)
        if m is None or not m.group(2):
            raise Refused(404, f"no such path {path}", "not_found")
        if m.group(2) == "/chat/completions":
            return "chat", m.group(1), self.settings.call_timeout_s
        return "reward", m.group(1), _QUICK_S

    def _guard(self, request: Request) -> None:
        if self.token and not self.authorized(request.headers.get("authorization")):
            raise Refused(401, "missing or wrong bearer token (producer.agent_endpoint.token)", "unauthorized")
