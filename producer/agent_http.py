"""The black-box agents' HTTP API (producer.agent_endpoint; docs/multi-turn.md has the
reference). It is the admin endpoint's server (common/control/http.py) with other
routes: the same hardening (the token checked before a byte of the body is read, a
declared Content-Length of at most `max_body_bytes`, socket timeouts, a per-request
deadline, at most `max_connections` at once). Requests run on producer/agents.py's
`AgentEpisodes` (engine thread); this module only routes, reads and answers.

    POST /v1/groups                                 open a group of G episodes
    POST /v1/episodes/{id}/chat/completions         one model turn (OpenAI chat.completions)
    POST /v1/episodes/{id}/reward                   close and publish
    GET  /v1/episodes/{id}                          the episode's state and messages
    GET  /v1/models                                 the served model (OpenAI clients ask)
"""
from __future__ import annotations

import json
import logging
import re

from common.config import AgentEndpointSettings
from common.control.http import ServiceHttp, _Handler
from producer import telemetry
from producer.agents import AgentEpisodes, error_body

log = logging.getLogger("rlstream.producer.agents")

_EPISODE = re.compile(r"^/v1/episodes/([0-9a-f]{1,64})(/chat/completions|/reward)?$")
_QUICK_S = 30.0
"""How long a command other than a chat call may wait for the engine's thread (one engine step)."""


class _AgentHandler(_Handler):
    service: "AgentHttp"

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if not self._agent_guard():
            return
        if path == "/v1/models":
            name = self.service.agents.engine.model_dir.name
            self._json(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rlstream"}]})
            return
        m = _EPISODE.match(path)
        if m is None or m.group(2):
            self._json(404, error_body(f"no such path {path}", "not_found"))
            return
        self._json(*self.service.agents.call("describe", m.group(1), {}, _QUICK_S))

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        asked_close = self.close_connection
        self.close_connection = True  # until the body is read: its bytes must not pass for a request
        m = _EPISODE.match(path)
        if path == "/v1/groups":
            kind, eid, wait = "open", None, _QUICK_S
        elif m is not None and m.group(2):
            kind, eid = ("chat" if m.group(2) == "/chat/completions" else "reward"), m.group(1)
            wait = self.service.settings.call_timeout_s if kind == "chat" else _QUICK_S
        else:
            self._json(404, error_body(f"no such path {path}", "not_found"))
            return
        if not self._agent_guard():  # before a byte of the body is read
            return
        raw = self._read_body()
        if raw is None:
            return
        self.close_connection = asked_close
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            body, why = None, f"the body is not JSON: {e}"
        else:
            why = "the body must be a JSON object"
        if not isinstance(body, dict):
            telemetry.AGENT_REFUSED.labels(kind="invalid_request_error").inc()
            self._json(400, error_body(why, "invalid_request_error"))
            return
        self._json(*self.service.agents.call(kind, eid, body, wait))

    def _agent_guard(self) -> bool:
        if self.service.token and not self.service.authorized(self.headers.get("Authorization")):
            telemetry.AGENT_REFUSED.labels(kind="unauthorized").inc()
            self._json(401, error_body("missing or wrong bearer token (producer.agent_endpoint.token)",
                                   "unauthorized"))
            return False
        return True


class AgentHttp(ServiceHttp):
    """The agent endpoint on its own port; `agents.base_url` is set to its address."""

    handler_base = _AgentHandler

    def __init__(self, settings: AgentEndpointSettings, agents: AgentEpisodes):
        self.settings, self.agents = settings, agents
        self.max_body_bytes = settings.max_body_bytes
        super().__init__(settings.host, settings.port, lambda: (True, {}), admin_token=settings.token,
                         client_timeout_s=10.0, request_deadline_s=settings.call_timeout_s + 30.0,
                         max_connections=settings.max_connections)
        agents.base_url = self.url

    def start(self) -> "AgentHttp":
        self._thread.start()
        log.info("agent endpoint: serving /v1/groups and /v1/episodes/{id}/chat/completions on %s", self.url)
        return self
