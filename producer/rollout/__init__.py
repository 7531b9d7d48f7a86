"""The rollout subsystem: how the producer turns admitted tasks into records.

    task.py         Task(prompt, reference, score): bound at the prompt source
    environment.py  Environment, ModelTurn, StepResult: the environment protocol
    trajectory.py   Trajectory: one sample as it grows; `to_rollout` builds every record
    driver.py       RolloutDriver: start / on_finished / has_work / drain / abort
    single_turn.py  SingleTurn: one engine sample per rollout (the default)
    episodes.py     EpisodeRunner and the Episodes driver (producer.episodes)
    observation.py  ObservationEncoder: environment text as token ids (episodes and agents)
    agents.py       AgentEpisodes, the Agents driver (producer.agent_endpoint)

`build_driver` is the one place that chooses among them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: producer/groups.py imports task.py from this package
    from rlstream.common.config import ProducerSettings
    from rlstream.producer.groups import InFlightGroups
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
        from rlstream.common.config import EpisodeSettings
        from rlstream.producer.rollout.agents.driver import AgentEpisodes, task_for

        held_back, prompts, verify = agent_tasks

        def take_task(body: dict):  # the task of a group an agent opens, or the reason that holds it back
            return held_back() or task_for(body, prompts, verify)

        return AgentEpisodes(engine, pcfg.agent_endpoint, pcfg.episodes or EpisodeSettings(), sampling, groups,
                             pcfg.group_size, take_task, producer_id).serve()
    if pcfg.episodes is not None:
        from rlstream.common.tasks.envs import env_factory
        from rlstream.producer.rollout.episodes import EpisodeRunner, Episodes

        runner = EpisodeRunner(engine, pcfg.episodes, sampling, env_factory(pcfg.episodes))
        resumer = None
        if kafka is not None and pcfg.journal.enabled:
            from rlstream.producer.journal import open_journal

            resumer = open_journal(kafka, pcfg, runner, groups, agent_tasks[2], producer_id, rollout_ends)
        return Episodes(runner, groups, producer_id, resumer)
    from rlstream.producer.rollout.single_turn import SingleTurn

    return SingleTurn(engine, groups, sampling, producer_id)
