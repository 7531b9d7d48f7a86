"""The agent endpoint's driver over the scripted engine, no vLLM (the agent unit tests).

    make        (engine, groups, agents): AgentEpisodes over a ScriptedAgentEngine of `replies`
    command     queue a command as the HTTP server does
    serve       run the engine thread's side until a command is answered: (status, body, published)
    chat        a chat request body
    agent_http  context manager: the HTTP server over make()'s agents, the service loop on a thread
"""
from __future__ import annotations

import contextlib
import threading
import time

from rlstream.common.config import AgentEndpointSettings, EpisodeSettings
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.rollout.agents.driver import AgentEpisodes
from rlstream.producer.sample import SamplingConfig
from tests.support.scripted import ScriptedAgentEngine, task


def make(replies, group_size=2, take=None, **limits):
    eng = ScriptedAgentEngine(replies)
    groups = InFlightGroups("p")
    agents = AgentEpisodes(eng, AgentEndpointSettings(idle_timeout_s=60), EpisodeSettings(
        **{"max_turns": 3, "max_turn_tokens": 8, "max_episode_tokens": 40, **limits}),
        SamplingConfig(max_tokens=8), groups, group_size, take or (lambda body: task()), "p")
    agents.base_url = "http://x"
    return eng, groups, agents


def command(agents, kind, eid, body):
    """Queue a command as the HTTP server does; the caller runs poll() / steps."""
    return agents.submit(kind, eid, body)


def serve(eng, agents, fut, n=20):
    """Run the engine thread's side until `fut` is answered; returns (status, body)."""
    published = []
    for _ in range(n):
        published += agents.poll()
        if eng.has_work():
            assert agents.claim(eng.step()) == []
        if fut.done():
            return (*fut.result(), published)
    raise AssertionError("not answered")


def chat(messages, **kw):
    return {"messages": messages, **kw}


@contextlib.contextmanager
def agent_http(token: str = "tok", max_body_bytes: int = 4096):
    """The agent endpoint's HTTP server on a free loopback port, over make()'s agents (one group
    of one, calculator replies), with the service loop's part running on a thread."""
    from rlstream.producer.rollout.agents.http import AgentHttp

    eng, groups, agents = make(["c(1+2)"] * 8, group_size=1)
    http = AgentHttp(AgentEndpointSettings(token=token, max_body_bytes=max_body_bytes), agents).start()
    stop = threading.Event()

    def loop():  # the service loop's part
        while not stop.is_set():
            agents.poll()
            if eng.has_work():
                agents.claim(eng.step())
            time.sleep(0.005)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield http
    finally:
        stop.set()
        t.join(5)
        http.stop()
