"""The rollout drivers (producer/rollout/): each turns a group's task into records and
marks its samples done in InFlightGroups (the slots admission counts), over scripted
stand-in engines; and the service's loop is one short sequence of steps with no mode
branches (the drivers are chosen once, by producer/rollout/build.py)."""
from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np

from rlstream.common.record import decode, encode
from rlstream.common.tasks.envs.calculator import CalculatorEnv
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.rollout.episodes import EpisodeRunner, Episodes
from rlstream.producer.rollout.single_turn import SingleTurn
from rlstream.common.tasks.task import Task
from rlstream.producer.sample import FinishedSample, SamplingConfig
from tests.support.scripted import ScriptedEngine, TextCodec, settings, task

ROOT = Path(__file__).resolve().parents[3]


class GroupEngine(TextCodec):
    """Stand-in RolloutEngine for single-turn groups: a group of n finishes at the next step,
    sample i answering `replies[i]`."""

    def __init__(self, replies: list[str]):
        self.replies, self.version, self.submitted = replies, 2, []

    def submit_group(self, ids, n, tag, sampling):
        self.submitted.append((tag, n, ids))

    def step(self):
        out = []
        for tag, n, ids in self.submitted:
            for i in range(n):
                resp = self.encode(self.replies[i])
                out.append(FinishedSample(
                    tag=tag, sample_idx=i, group_size=n, request_id=f"{tag}/{i}", prompt_ids=ids,
                    response_ids=resp, logprobs=np.full(resp.size, -0.5, np.float32), finish_reason="stop",
                    stop_reason=None, dispatch_version=self.version, token_versions=[(self.version, resp.size)],
                    routed_experts=None, num_experts=0, logprobs_mode="processed_logprobs", submitted_at=0.0,
                    finished_at=0.0))
        self.submitted = []
        return out


def test_single_turn_submits_a_group_as_one_request_and_scores_each_sample_by_its_task():
    eng, groups = GroupEngine(["19", "20", "19 "]), InFlightGroups("p")
    driver = SingleTurn(eng, groups, SamplingConfig(max_tokens=8), "p")
    t = Task("12+7=", "19", lambda text: (float(text.strip() == "19"), {"correct": text.strip() == "19"}))
    gid = groups.open(t, 3)
    driver.start(gid, t, 3)
    assert [(tag, n) for tag, n, _ in eng.submitted] == [(gid, 3)]  # n=G: the engine shares the prefix
    finished = eng.step()
    records = driver.on_finished(finished[:2])
    assert len(groups) == 1  # one sample of the group still generating
    records += driver.on_finished(finished[2:])
    assert len(groups) == 0 and not driver.has_work()
    back = [decode(encode(r)) for r in records]
    assert [r.reward for r in back] == [1.0, 0.0, 1.0]
    assert all(r.prompt_text == "12+7=" and r.group_id == gid and r.loss_mask is None for r in back)
    assert back[1].reward_info == {"correct": False} and back[0].policy_version == 2


def test_episodes_run_g_episodes_per_task_and_free_the_group_after_the_last():
    eng, groups = ScriptedEngine({0: ["c(37+48)", "c(85-19)", "66$"], 1: ["66$"]}), InFlightGroups("p")
    driver = Episodes(EpisodeRunner(eng, settings(), SamplingConfig(max_tokens=16), CalculatorEnv), groups, "p")
    gid = groups.open(task(), 2)
    driver.start(gid, task(), 2)
    records, deadline = [], time.monotonic() + 30
    while driver.has_work():
        assert time.monotonic() < deadline
        records += driver.on_finished(eng.step() if eng.has_work() else [])
    assert len(groups) == 0 and sorted(r.sample_idx for r in records) == [0, 1]
    by = {r.sample_idx: decode(encode(r)) for r in records}
    assert by[0].loss_mask is not None and by[1].loss_mask is None  # schema 2 with tool output, else 1
    assert (by[0].reward, by[1].reward) == (1.0, 1.0) and by[0].prompt_text == "37+48-19="
    assert by[0].reward_info["turns"] == 3 and by[0].finish_reason == "stop"


def test_the_service_loop_is_short_and_names_no_mode():
    path = ROOT / "producer" / "service.py"
    src = path.read_text()
    assert len(src.splitlines()) <= 200
    names = {n.attr for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute)}
    assert not names & {"episodes", "agents", "agent_endpoint", "agent_http"}, names & {"episodes", "agents"}


def test_agents_step_through_on_finished_as_the_service_loop_drives_them():
    from tests.support.agent_endpoint import chat, command, make

    eng, groups, agents = make(["66"], group_size=1)
    records = []

    def answered(fut):  # the service loop: an engine step (if any), then driver.on_finished
        for _ in range(10):
            records.extend(agents.on_finished(eng.step() if eng.has_work() else []))
            if fut.done():
                return fut.result()
        raise AssertionError("not answered")

    st, opened = answered(command(agents, "open", None, {}))
    assert st == 200 and len(groups) == 1 and not agents.admits_prompts
    (eid,) = (e["episode_id"] for e in opened["episodes"])
    assert answered(command(agents, "chat", eid, chat([{"role": "user", "content": "37+48-19="}])))[0] == 200
    assert answered(command(agents, "reward", eid, {}))[1]["end"] == "verified"
    (rec,) = records
    assert rec.reward == 1.0 and rec.loss_mask is None and len(groups) == 0  # one model turn: schema 1
