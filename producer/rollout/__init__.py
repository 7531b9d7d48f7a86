"""The rollout subsystem: how the producer turns admitted tasks into records.

    trajectory.py   Trajectory: one sample as it grows; `to_rollout` builds every record
    driver.py       RolloutDriver: start / on_finished / has_work / drain / abort
    single_turn.py  SingleTurn: one engine sample per rollout (the default)
    episodes.py     EpisodeRunner and the Episodes driver (producer.episodes)
    observation.py  ObservationEncoder: environment text as token ids, once (episodes and agents)
    agents/         AgentEpisodes, the Agents driver, its OpenAI protocol and HTTP server (producer.agent_endpoint)
    build.py        build_driver: the one place that chooses among them and builds the chosen one

Tasks and the environment protocol they run against are rlstream.common.tasks
(common/tasks/task.py, common/tasks/environment.py).
"""
