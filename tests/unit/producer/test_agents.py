"""producer/rollout/agents/ (driver.py, openai.py, http.py): the black-box agent endpoint's logic
(request validation, token-in/token-out history, limits, ends, the record) over a
scripted stand-in engine (tests/support/scripted.py), and its HTTP hardening over a real socket;
tests/integration/test_agent_endpoint.py runs a real agent against the real engine."""
from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from rlstream.common import metrics
from rlstream.common.config import AgentEndpointSettings, ProducerSettings
from rlstream.common.errors import AgentRequestError
from rlstream.common.record import decode, encode
from rlstream.toy.tinymodel import build_tokenizer
from rlstream.producer.rollout.agents.openai import new_messages, parse_chat
from rlstream.producer.sample import SamplingConfig
from tests.support.agent_endpoint import agent_http, chat, command, make, serve
from tests.support.scripted import TOK


# ------------------------------------------------------------------- requests

def test_chat_requests_are_validated_naming_what_to_fix():
    s = SamplingConfig(temperature=1.0)
    ok = parse_chat(chat([{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]}],
                         max_tokens=4, stop=")", logprobs=True, temperature=1.0, model="any"), s)
    assert ok.messages == [{"role": "user", "content": "1+2="}] and ok.stop == (")",) and ok.max_tokens == 4
    bad = {"tools": chat([{"role": "user", "content": "x"}], tools=[{}]),
           "stream": chat([{"role": "user", "content": "x"}], stream=True),
           "n:": chat([{"role": "user", "content": "x"}], n=2),
           "temperature": chat([{"role": "user", "content": "x"}], temperature=0.7),
           "top_logprobs": chat([{"role": "user", "content": "x"}], top_logprobs=3),
           "max_tokens": chat([{"role": "user", "content": "x"}], max_tokens=0),
           "stop": chat([{"role": "user", "content": "x"}], stop=[1]),
           "messages:": {"messages": []},
           "messages[0].role": chat([{"role": "bot", "content": "x"}]),
           "content": chat([{"role": "user", "content": None}])}
    for what, body in bad.items():
        with pytest.raises(AgentRequestError) as e:
            parse_chat(body, s)
        assert e.value.status == 400 and what in str(e.value), what


def test_a_call_must_repeat_the_history_exactly_and_add_no_assistant_message():
    hist = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "c(1+2)"}]
    assert new_messages(hist, hist + [{"role": "tool", "content": "=3,"}]) == [{"role": "tool", "content": "=3,"}]
    for msgs, where in ((hist, "do not extend"),
                        ([hist[0], {"role": "assistant", "content": "c(1+2) "}, {"role": "tool", "content": "x"}],
                         "messages[1] differs"),
                        (hist + [{"role": "assistant", "content": "3"}], "messages[2]: an assistant")):
        with pytest.raises(AgentRequestError) as e:
            new_messages(hist, msgs)
        assert e.value.status == 409 and e.value.kind == "history_mismatch" and where in str(e.value)


# ------------------------------------------------------------------- episodes

def test_an_agent_episode_is_recorded_token_in_token_out_and_published_on_its_reward():
    eng, groups, agents = make(["c(37+48)", "66"])
    st, opened, _ = serve(eng, agents, command(agents, "open", None, {}))
    assert st == 200 and opened["prompt"] == "37+48-19=" and len(opened["episodes"]) == 2 and len(groups) == 1
    e0, e1 = (e["episode_id"] for e in opened["episodes"])
    assert opened["episodes"][0]["base_url"] == f"http://x/v1/episodes/{e0}"
    msgs = [{"role": "user", "content": "37+48-19="}]
    st, r1, _ = serve(eng, agents, command(agents, "chat", e0, chat(msgs, logprobs=True, max_tokens=50)))
    assert st == 200 and r1["choices"][0]["message"]["content"] == "c(37+48)"
    assert [c["logprob"] for c in r1["choices"][0]["logprobs"]["content"]] == r1["rlstream"]["logprobs"]
    assert r1["rlstream"]["response_offset"] == 0 and r1["usage"]["prompt_tokens"] == 9
    eng.version = 3  # a weight update between the turns
    msgs += [{"role": "assistant", "content": "c(37+48)"}, {"role": "tool", "content": "=85,"}]
    st, r2, _ = serve(eng, agents, command(agents, "chat", e0, chat(msgs)))
    assert st == 200 and r2["choices"][0]["logprobs"] is None and r2["rlstream"]["response_offset"] == 8 + 4
    st, closed, published = serve(eng, agents, command(agents, "reward", e0, {"reward": 1, "info": {"k": "v"}}))
    assert closed == {"episode_id": e0, "end": "reported", "reward": 1.0, "turns": 2, "published": True}
    (rec,) = published
    rec = decode(encode(rec))  # the wire's validation
    assert rec.loss_mask is not None and rec.reward == 1.0 and rec.reward_info["end"] == "reported" and rec.reward_info["k"] == "v"
    assert TOK.decode(rec.response_ids.tolist()) == "c(37+48)=85,66"
    np.testing.assert_array_equal(rec.loss_mask, [1] * 8 + [0] * 4 + [1] * 2)
    lp = np.r_[r1["rlstream"]["logprobs"], [0.0] * 4, r2["rlstream"]["logprobs"]].astype(np.float32)
    np.testing.assert_array_equal(rec.logprobs, lp)
    assert rec.token_versions.tolist() == [[0, 8], [3, 6]]  # the tool message: the version when appended
    assert rec.routed_experts.shape[0] == 9 + 14 - 1 and rec.routed_experts[:16, 0, 0].tolist() == [0] * 16
    assert len(groups) == 1  # episode 1 still open
    st, closed, published = serve(eng, agents, command(agents, "reward", e1, {}))  # no call: nothing to publish
    assert closed["end"] == "verified" and not closed["published"] and published == [] and len(groups) == 0
    assert serve(eng, agents, command(agents, "reward", e1, {}))[0] == 404


def test_refused_calls_leave_the_episode_as_it_was():
    eng, groups, agents = make(["c(1+2)", "3"], group_size=1, max_turns=2, max_episode_tokens=12)
    (ep,) = serve(eng, agents, command(agents, "open", None, {}))[1]["episodes"]
    eid, msgs = ep["episode_id"], [{"role": "user", "content": "37+48-19="}]
    busy = command(agents, "chat", eid, chat(msgs))
    agents.poll()  # submitted, not stepped: generating
    st, err, _ = serve(eng, agents, command(agents, "chat", eid, chat(msgs)))
    assert st == 409 and err["error"]["type"] == "busy"
    assert busy.result()[0] == 200 and busy.result()[1]["choices"][0]["message"]["content"] == "c(1+2)"
    good = msgs + [{"role": "assistant", "content": "c(1+2)"}, {"role": "tool", "content": "=3,"}]
    bad = msgs + [{"role": "assistant", "content": "c(1+3)"}, {"role": "tool", "content": "=4,"}]
    assert serve(eng, agents, command(agents, "chat", eid, chat(bad)))[0] == 409
    assert serve(eng, agents, command(agents, "chat", eid, chat(good, temperature=0.5)))[0] == 400
    st, err, _ = serve(eng, agents, command(agents, "chat", eid, chat(good + [{"role": "user", "content": "1234"}])))
    assert st == 400 and err["error"]["type"] == "max_tokens"  # 6 + 8 would leave no room in 12
    st, r, _ = serve(eng, agents, command(agents, "chat", eid, chat(good)))
    assert st == 200 and r["choices"][0]["message"]["content"] == "3"
    more = good + [{"role": "assistant", "content": "3"}, {"role": "user", "content": "?"}]
    st, err, _ = serve(eng, agents, command(agents, "chat", eid, chat(more)))
    assert st == 400 and err["error"]["type"] == "max_turns"
    assert serve(eng, agents, command(agents, "chat", "ffff", chat(msgs)))[0] == 404
    st, closed, (rec,) = serve(eng, agents, command(agents, "reward", eid, {}))  # the verifier scores "3"
    assert closed["end"] == "verified" and rec.reward == 0.0 and rec.reward_info["turns"] == 2


def test_abandoned_episodes_end_unpublished_and_admission_holds_groups():
    eng, groups, agents = make(["c(1+2)"], group_size=1)
    agents.settings = AgentEndpointSettings(idle_timeout_s=0.05)
    before = metrics.value("rlstream_producer_episodes_total", end="abandoned") or 0
    (ep,) = serve(eng, agents, command(agents, "open", None, {}))[1]["episodes"]
    serve(eng, agents, command(agents, "chat", ep["episode_id"], chat([{"role": "user", "content": "1="}])))
    time.sleep(0.1)
    assert agents.poll() == [] and agents.episodes == {} and len(groups) == 0
    assert metrics.value("rlstream_producer_episodes_total", end="abandoned") == before + 1
    _, _, held = make([], take=lambda body: "staleness")
    st, err, _ = serve(eng, held, command(held, "open", None, {}))
    assert st == 429 and err["error"]["type"] == "staleness"


def test_shutdown_answers_waiting_calls_and_ends_every_episode():
    eng, groups, agents = make(["c(1+2)"], group_size=2)
    eps = serve(eng, agents, command(agents, "open", None, {}))[1]["episodes"]
    waiting = command(agents, "chat", eps[0]["episode_id"], chat([{"role": "user", "content": "1="}]))
    agents.poll()
    agents.shutdown()
    assert waiting.result()[0] == 503 and agents.episodes == {} and len(groups) == 0
    assert agents.claim(eng.step()) == []  # the turn still in the engine is dropped, not mistaken for a group
    assert agents.submit("open", None, {}).result(timeout=1.0)[0] == 503


def test_the_first_call_goes_through_the_chat_template_and_tool_messages_as_deltas():
    tok = build_tokenizer()
    tok.chat_template = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}"
                         "{{ eos_token }}:{%- elif m['role'] == 'tool' -%}={{ m['content'] }},"
                         "{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
                         "{%- if add_generation_prompt -%}a:{%- endif -%}")
    eng, groups, agents = make(["c(1+2)", "3"], group_size=1)
    eng.tokenizer = lambda: tok
    agents.encoder.tok, agents.encoder.template = tok, True
    (ep,) = serve(eng, agents, command(agents, "open", None, {}))[1]["episodes"]
    msgs = [{"role": "user", "content": "1+2="}]
    serve(eng, agents, command(agents, "chat", ep["episode_id"], chat(msgs)))
    msgs += [{"role": "assistant", "content": "c(1+2)"}, {"role": "tool", "content": "3"}]
    serve(eng, agents, command(agents, "chat", ep["episode_id"], chat(msgs)))
    _, _, (rec,) = serve(eng, agents, command(agents, "reward", ep["episode_id"], {"reward": 0.5}))
    assert tok.decode(rec.prompt_ids.tolist(), skip_special_tokens=False) == "1+2=a:"
    assert tok.decode(rec.response_ids.tolist(), skip_special_tokens=False) == "c(1+2)<eos>:=3,a:3"
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    (ep,) = serve(eng, agents, command(agents, "open", None, {}))[1]["episodes"]
    st, err, _ = serve(eng, agents, command(agents, "chat", ep["episode_id"], chat(msgs[:1])))
    assert st == 400 and "chat template refused them: roles must alternate" in err["error"]["message"]


def test_agent_endpoint_settings_are_off_by_default_and_need_a_token_off_loopback():
    assert ProducerSettings().agent_endpoint is None
    assert ProducerSettings.model_validate({"agent_endpoint": {}}).agent_endpoint.token is None
    with pytest.raises(ValidationError, match="token: required"):
        ProducerSettings.model_validate({"agent_endpoint": {"host": "0.0.0.0"}})
    with pytest.raises(ValidationError):
        AgentEndpointSettings(idle_timeout_s=0)
    from rlstream.common.config import dump_config, load_config

    assert "agent-s3cret" not in dump_config(load_config(None, ["producer.agent_endpoint.token=agent-s3cret"],
                                                         environ={}))


# ------------------------------------------------------------------- HTTP

@pytest.fixture
def endpoint():
    with agent_http() as http:
        yield http


def test_http_routes_auth_first_and_bounded_bodies(endpoint):
    url, auth = endpoint.url, {"Authorization": "Bearer tok"}
    opened = httpx.post(f"{url}/v1/groups", json={"prompt": "1+2=", "answer": "3"}, headers=auth, timeout=10)
    assert opened.status_code == 200
    base = opened.json()["episodes"][0]["base_url"]
    import openai

    client = openai.OpenAI(base_url=base, api_key="tok", max_retries=0, timeout=10)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2="}], logprobs=True)
    assert r.choices[0].message.content == "c(1+2)" and len(r.choices[0].logprobs.content) == 6
    assert httpx.get(base, headers=auth, timeout=10).json()["turns"] == 1
    assert httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == "tiny"
    assert httpx.post(f"{base}/chat/completions", json={}, timeout=10).status_code == 401
    assert httpx.post(f"{url}/v1/nope", json={}, headers=auth, timeout=10).status_code == 404
    assert httpx.post(f"{base}/reward", content=b"[1]", headers=auth, timeout=10).status_code == 400
    assert httpx.post(f"{base}/reward", content=b"x" * 5000, headers=auth, timeout=10).status_code == 413
    # a wrong token is answered before a byte of the (never sent) body is read
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as s:
        s.sendall(b"POST /v1/groups HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer no\r\nContent-Length: 100\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 401")
    closed = httpx.post(f"{base}/reward", json={"reward": 1.0}, headers=auth, timeout=10).json()
    assert closed["published"] and closed["end"] == "reported"


def test_a_group_task_is_the_agents_own_prompt_or_the_next_of_the_prompt_source():
    from rlstream.producer.rollout.build import task_for
    from rlstream.common.tasks.verifiers import get_verifier

    verify, dry = get_verifier("exact_match"), type("Dry", (), {"take": lambda self: None})()
    own = task_for({"prompt": "1+2=", "answer": 3}, dry, verify)
    assert (own.prompt, own.reference, own.score("3")[0], own.score("4")[0]) == ("1+2=", "3", 1.0, 0.0)
    assert task_for({"prompt": "1+2="}, dry, verify).score is None
    assert task_for({}, dry, verify) == "no_prompts"
    eng, groups, agents = make(["3"], group_size=1, take=lambda body: task_for(body, dry, verify))
    (ep,) = serve(eng, agents, command(agents, "open", None, {"prompt": "1+2="}))[1]["episodes"]
    serve(eng, agents, command(agents, "chat", ep["episode_id"], chat([{"role": "user", "content": "1+2="}])))
    st, err, _ = serve(eng, agents, command(agents, "reward", ep["episode_id"], {}))
    assert st == 400 and "no verifier" in err["error"]["message"]
