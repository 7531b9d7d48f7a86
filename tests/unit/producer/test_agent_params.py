"""producer/rollout/agents/ (openai.py, driver.py): every field of an agent's request is type- and range-checked,
so a wrong one is a 400 naming it (the error body's `param`), never a 500, and the
episode stays as it was."""
from __future__ import annotations

import httpx
import pytest

from rlstream.common.errors import AgentRequestError
from rlstream.producer.rollout.agents.openai import BadParameter, parse_chat
from rlstream.producer.sample import SamplingConfig
from tests.support.agent_endpoint import agent_http, chat, command, make, serve

USER = [{"role": "user", "content": "1+2="}]

BAD_CHAT = [
    (chat(USER, temperature="hot"), "temperature"),
    (chat(USER, temperature=True), "temperature"),
    (chat(USER, temperature=float("nan")), "temperature"),
    (chat(USER, top_p=[1]), "top_p"),
    (chat(USER, presence_penalty=0.5), "presence_penalty"),
    (chat(USER, frequency_penalty="x"), "frequency_penalty"),
    (chat(USER, stop=5), "stop"),
    (chat(USER, stop={"a": 1}), "stop"),
    (chat(USER, stop=["a", ""]), "stop"),
    (chat(USER, stop=[")"] * 5), "stop"),
    (chat(USER, max_tokens=-1), "max_tokens"),
    (chat(USER, max_tokens=True), "max_tokens"),
    (chat(USER, max_tokens="8"), "max_tokens"),
    (chat(USER, max_tokens=2.5), "max_tokens"),
    (chat(USER, max_completion_tokens=0), "max_completion_tokens"),
    (chat(USER, n="1"), "n"),
    (chat(USER, n=True), "n"),
    (chat(USER, logprobs="yes"), "logprobs"),
    (chat(USER, stream="false"), "stream"),
    (chat(USER, top_logprobs="3"), "top_logprobs"),
    ({"messages": "1+2="}, "messages"),
    ({"messages": {"role": "user"}}, "messages"),
    ({"messages": ["1+2="]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[f"{p}={str(b.get(p, b.get('messages')))[:20]}"
                                                        for b, p in BAD_CHAT])
def test_a_wrong_chat_field_is_a_400_naming_it(body, param):
    with pytest.raises(BadParameter) as e:
        parse_chat(body, SamplingConfig(temperature=1.0))
    assert e.value.status == 400 and e.value.param == param and str(e.value).startswith(f"{param}: ")


@pytest.mark.timeout(30)
def test_right_types_pass():
    call = parse_chat(chat(USER, temperature=1, top_p=1.0, presence_penalty=0, n=1, stream=False, logprobs=False,
                           top_logprobs=0, max_tokens=4, max_completion_tokens=6, stop=None), SamplingConfig())
    assert (call.max_tokens, call.stop, call.logprobs) == (6, (), False)


def _opened(agents, eng):
    (ep,) = serve(eng, agents, command(agents, "open", None, {}))[1]["episodes"]
    return ep["episode_id"]


@pytest.mark.timeout(30)
def test_the_engine_thread_answers_400_with_the_param_and_the_episode_goes_on():
    eng, groups, agents = make(["c(1+2)"], group_size=1)
    eid = _opened(agents, eng)
    for body, param in ((chat(USER, temperature="hot"), "temperature"), (chat(USER, stop=5), "stop")):
        st, err, _ = serve(eng, agents, command(agents, "chat", eid, body))
        assert st == 400 and err["error"]["param"] == param, err
    st, ok, _ = serve(eng, agents, command(agents, "chat", eid, chat(USER)))
    assert st == 200 and ok["choices"][0]["message"]["content"] == "c(1+2)"


BAD_REWARD = [
    ({"reward": "1"}, "reward"),
    ({"reward": [1]}, "reward"),
    ({"reward": 1e300}, "reward"),  # a record beyond common/record/schema.py's bound would be refused at publication
    ({"reward": float("inf")}, "reward"),
    ({"reward": 1, "info": [1]}, "info"),
    ({"reward": 1, "info": {"k": {"deep": 1}}}, "info.k"),
    ({"reward": 1, "info": {"k": 2**70}}, "info.k"),  # msgpack cannot encode it
]


@pytest.mark.timeout(30)
def test_a_wrong_reward_or_info_is_a_400_and_the_episode_stays_open():
    eng, groups, agents = make(["c(1+2)"], group_size=1)
    eid = _opened(agents, eng)
    serve(eng, agents, command(agents, "chat", eid, chat(USER)))
    for body, param in BAD_REWARD:
        st, err, published = serve(eng, agents, command(agents, "reward", eid, body))
        assert (st, err["error"]["param"], published) == (400, param, []), (body, err)
    st, closed, published = serve(eng, agents, command(agents, "reward", eid, {"reward": -1e6, "info": {"n": 3}}))
    assert st == 200 and closed["published"] and published[0].reward == -1e6


@pytest.mark.timeout(30)
@pytest.mark.parametrize("body,param", [({"prompt": {"text": "1+2="}}, "prompt"), ({"prompt": ""}, "prompt"),
                                        ({"prompt": "1+2=", "answer": [3]}, "answer"),
                                        ({"prompt": "1+2=", "answer": True}, "answer")])
def test_a_wrong_task_is_a_400_naming_it(body, param):
    from rlstream.producer.rollout.build import task_for
    from rlstream.common.tasks.verifiers import get_verifier

    with pytest.raises(AgentRequestError) as e:
        task_for(body, None, get_verifier("exact_match"))
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.timeout(60)
def test_over_http_a_wrong_type_is_a_json_400_not_a_500():
    with agent_http() as endpoint:
        url, auth = endpoint.url, {"Authorization": "Bearer tok"}
        base = httpx.post(f"{url}/v1/groups", json={}, headers=auth, timeout=10).json()["episodes"][0]["base_url"]
        for body, param in ((chat(USER, temperature="hot"), "temperature"), (chat(USER, stop=5), "stop"),
                            (chat(USER, max_tokens=-1), "max_tokens"), ({"messages": "hi"}, "messages")):
            r = httpx.post(f"{base}/chat/completions", json=body, headers=auth, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
