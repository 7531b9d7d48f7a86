"""Black-box agents (producer.agent_endpoint, docs/multi-turn.md): a real agent program
(tests/support/calc_agent.py, the official `openai` client over real HTTP, its own
process) drives episodes served by the producer service's loop on the session's vLLM
CPU engine; the episodes are published to the real broker. The records hold exactly
what the endpoint returned (token ids and log-probs of every model turn, in order,
loss mask 1 there and 0 on the tool messages), per-token versions and routing rows for
every input position; a group completes with G records; refused calls get their 4xx;
an abandoned episode is ended (counted) and publishes nothing."""
from __future__ import annotations

import json
import sys
import time
from collections import Counter

import numpy as np
import pytest

from rlstream.common import metrics
from rlstream.common.config import RlstreamConfig
from tests.fixtures.kafka import make_kafka_settings
from tests.support.topics import announce_trainer_start, read_valid_rollouts
from tests.support.program import Program

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, TOKEN = 2, "agent-secret"


def _service(broker, tiny_model_dir, tmp_path, engine):
    from rlstream.toy.build import ensure_data
    from rlstream.producer.service import ProducerService

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs")
    cfg = RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "producer": {"group_size": G, "max_groups_in_flight": 4,
                     "prompts": {"type": "jsonl", "path": str(tmp_path / "data" / "train.jsonl")},
                     "episodes": {"max_turns": 3, "max_turn_tokens": 6, "max_episode_tokens": 40},
                     "agent_endpoint": {"token": TOKEN, "idle_timeout_s": 2.0, "call_timeout_s": 60}},
        "consumer": {"group_size": G, "groups_per_batch": 2}})
    ensure_data(cfg, n_train=16, n_heldout=4)
    announce_trainer_start(kafka, groups_per_batch=2, group_size=G)
    svc = ProducerService(cfg, broker.bootstrap)
    svc.start(engine=engine)
    return svc, kafka


@pytest.mark.timeout(300)
def test_agent_drives_episodes_over_http_and_they_are_published(broker, rollout_engine, tiny_model_dir, tmp_path):
    svc, kafka = _service(broker, tiny_model_dir, tmp_path, rollout_engine)
    ends0 = {e: metrics.value("rlstream_producer_episodes_total", end=e) or 0 for e in ("abandoned", "verified")}
    out = tmp_path / "calls.jsonl"
    agent = Program([sys.executable, "-m", "tests.support.calc_agent", "--url", svc.driver.url, "--token", TOKEN,
                     "--groups", "3", "--abandon", "1", "--check-refusals", "--out", str(out)],
                    tmp_path, name="agent").start()
    try:
        deadline = time.monotonic() + 180
        while agent.alive or svc.driver.episodes:  # the abandoned one ends after idle_timeout_s
            assert time.monotonic() < deadline, "the agent or its episodes did not finish"
            svc.iterate()
        assert agent.returncode == 0, agent.log_tail(3000)
    finally:
        if agent.alive:
            agent.kill()
        svc.drain()  # what SIGTERM runs: the endpoint closes, every acknowledgement is awaited
        svc.engine = None  # the session's: not ours to close
        svc.close()
    records = read_valid_rollouts(kafka)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    _check_refusals(lines)
    _check_records(records, lines)
    assert metrics.value("rlstream_producer_episodes_total", end="abandoned") - ends0["abandoned"] == 1
    assert metrics.value("rlstream_producer_episodes_total", end="verified") - ends0["verified"] == 3


def _check_refusals(lines):
    refusals = {x["case"]: x for x in lines if x["kind"] == "refusal"}
    assert refusals["token"]["status"] == 401
    assert refusals["history"]["status"] == 409 and refusals["history"]["type"] == "history_mismatch"
    assert refusals["temperature"]["status"] == 400
    assert refusals["closed"]["status"] == 200 and refusals["closed"]["published"]  # its one turn


def _check_records(records, lines):
    groups = [x for x in lines if x["kind"] == "group"]
    by_group = Counter(r.group_id for r in records)
    assert [by_group[g["group_id"]] for g in groups] == [G, G, G - 1]  # the last group's abandoned episode
    calls: dict[str, list] = {}
    for x in lines:
        if x["kind"] == "call":
            calls.setdefault(x["episode_id"], []).append(x)
    rewards = [x for x in lines if x["kind"] == "reward" and x.get("published")]
    assert {x["end"] for x in rewards} == {"reported", "verified"}
    by_sample = {(r.group_id, r.sample_idx): r for r in records}
    ids = {ep["episode_id"]: (g["group_id"], i) for g in groups for i, ep in enumerate(g["episodes"])}
    checked = 0
    for eid, turns in calls.items():
        r = by_sample.get(ids.get(eid))
        if r is None:
            continue  # the refusal check's episode, or the abandoned one
        assert r.loss_mask is not None and r.reward_info["turns"] == len(turns) >= 2
        mask = r.loss_mask
        for t in turns:  # what the endpoint returned is in the record, where it said
            a, n = t["response_offset"], len(t["token_ids"])
            assert r.response_ids[a:a + n].tolist() == t["token_ids"]
            assert mask[a:a + n].all()
            np.testing.assert_array_equal(r.logprobs[a:a + n], np.asarray(t["logprobs"], dtype=np.float32))
            np.testing.assert_allclose(t["logprobs_openai"], t["logprobs"])
        assert int(mask.sum()) == sum(len(t["token_ids"]) for t in turns)  # the rest: tool messages
        assert (r.logprobs[~mask] == 0).all() and r.routed_experts.shape[0] == r.prompt_ids.size + r.num_tokens - 1
        assert r.policy_version == 0 and r.reward in (0.0, 1.0)
        checked += 1
    assert checked == 2 * G + G - 1
