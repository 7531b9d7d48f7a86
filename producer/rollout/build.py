"""`build_driver`: the one place that chooses the rollout driver (producer/rollout/driver.py
has the protocol) from the settings and builds it, with what it needs: an agent endpoint's
HTTP server, an episode journal.
"""
from __future__ import annotations

from collections.abc import Callable

from rlstream.common.config import EpisodeSettings, ProducerSettings
from rlstream.common.tasks.envs import env_factory
from rlstream.common.tasks.task import Task
from rlstream.producer import telemetry
from rlstream.producer.groups import InFlightGroups
from rlstream.producer.journal import open_journal
from rlstream.producer.rollout.agents.driver import AgentEpisodes
from rlstream.producer.rollout.agents.http import AgentHttp
from rlstream.producer.rollout.agents.openai import BadParameter
from rlstream.producer.rollout.episodes import EpisodeRunner, Episodes
from rlstream.producer.rollout.single_turn import SingleTurn
from rlstream.producer.sample import SamplingConfig


def build_driver(pcfg: ProducerSettings, engine, groups: InFlightGroups, sampling: SamplingConfig,
                 producer_id: str, agent_tasks: tuple[Callable[[], str | None], object, Callable], kafka=None,
                 rollout_ends: Callable[[], dict[int, int]] = dict):
    """The driver the settings name: agents with `producer.agent_endpoint` (`producer.episodes`
    then gives their limits only), episodes with `producer.episodes`, else single-turn.
    `agent_tasks`: (held_back, prompts, verify): the admission gate (a reason, or None), the
    prompt source and `producer.verifier`, from which an agent's `open` takes its group's task.
    `kafka`: with it, episodes are journaled and orphans resumed (producer.journal, producer/journal/);
    `rollout_ends`: the rollouts topic's end offsets, a lower bound (producer/admission.py `TopicEnds`)."""
    if pcfg.agent_endpoint is not None:
        return _build_agents(pcfg, engine, groups, sampling, producer_id, agent_tasks)
    if pcfg.episodes is not None:
        runner = EpisodeRunner(engine, pcfg.episodes, sampling, env_factory(pcfg.episodes))
        resumer = None
        if kafka is not None and pcfg.journal.enabled:
            resumer = open_journal(kafka, pcfg, runner, groups, agent_tasks[2], producer_id, rollout_ends)
        return Episodes(runner, groups, producer_id, resumer)
    return SingleTurn(engine, groups, sampling, producer_id)


def _build_agents(pcfg: ProducerSettings, engine, groups: InFlightGroups, sampling: SamplingConfig,
                  producer_id: str, agent_tasks: tuple[Callable[[], str | None], object, Callable]) -> AgentEpisodes:
    """The agents' driver with its HTTP endpoint started on it (the server is given the driver;
    the driver is given the server, which its `drain` stops and its `close` closes)."""
    held_back, prompts, verify = agent_tasks

    def take_task(body: dict):  # the task of a group an agent opens, or the reason that holds it back
        return held_back() or task_for(body, prompts, verify)

    agents = AgentEpisodes(engine, pcfg.agent_endpoint, pcfg.episodes or EpisodeSettings(), sampling, groups,
                           pcfg.group_size, take_task, producer_id)
    return agents.attach(AgentHttp(pcfg.agent_endpoint, agents).start())


def task_for(body: dict, prompts, verify) -> Task | str:
    """A new group's task: the agent's own (`prompt`, optional `answer`: scored by
    `verify` when given) or the next of the producer's prompt source ("no_prompts" when dry)."""
    if body.get("prompt") is not None:
        prompt, answer = body["prompt"], body.get("answer")
        if not isinstance(prompt, str) or not prompt:
            raise BadParameter("prompt", "a non-empty string")
        if answer is None:
            return Task(prompt, "", None)
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise BadParameter("answer", "a string or a number (what the producer's verifier compares with)")
        return Task.checked_by(verify, prompt, str(answer))
    p = prompts.take()
    if p is None:
        telemetry.HELD_BACK.labels(reason="no_prompts").inc()
        return "no_prompts"
    return p.task
