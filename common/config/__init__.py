"""Typed, validated configuration: one model per service, one YAML file per deployment.

A file in `configs/` has top-level sections; each service reads the shared ones
(`kafka`, `model`, `staleness`, `cli`) and its own (`broker`, `producer`,
`consumer`, `demo`, `experiment`). Every field has a default, bounds and a docstring;
unknown keys and bad values are refused with a message naming the dotted key.

Where each part lives:
  base.py      `_Section` (the base of every section) and shared value helpers
  kafka.py     `kafka` (KafkaSettings, TopicSettings) and `broker` (BrokerSettings)
  shared.py    `model`, `staleness` (ControlSettings, the runtime-tunable settings,
               and AutoStalenessSettings), `cli`, and the HTTP and liveness settings
               of both services
  engine.py    `producer.engine` (EngineSettings)
  producer.py  `producer`: prompt sources, episodes, journal, agent endpoint
  consumer.py  `consumer`: loss, optimizer, parallel layout, memory, checkpoint,
               weight sync, stress
  harness.py   the tooling's `demo` and `experiment` sections
  load.py      RlstreamConfig (the whole file), the declared RLSTREAM_* aliases,
               SECRET_KEYS, load_config and dump_config

Precedence (later wins):
  defaults < YAML file < declared aliases < RLSTREAM__SECTION__KEY < --set < dedicated flags
- declared aliases (`ENV_ALIASES`): the few short `RLSTREAM_*` variables
  deployments set, each declared once with the settings it sets and its docs;
  taken verbatim as strings (a token is never parsed as a number). The
  generic form below and `--set` override them, so one service can differ.
- generic environment: `RLSTREAM__SECTION__KEY=value`, e.g.
  `RLSTREAM__KAFKA__BOOTSTRAP_SERVERS=broker:9092` (values parsed as YAML scalars)
- CLI: `--set section.key=value` (repeatable), then the dedicated flags of
  `rlstream` (`--log-level`; `ctl --url/--token`), passed as `flags`.
`--dry-run` prints the result, secrets (`SECRET_KEYS`) masked.
The launcher's `WORLD_SIZE` (torchrun), when set, is given to the validators
too, so a `consumer.parallel` layout that cannot fit the job is refused here.

This package imports neither torch, vLLM nor Megatron, so a typo fails in a
second, before any engine starts. Import from the package
(`from rlstream.common.config import ConsumerSettings`): it re-exports the API below.
"""
from __future__ import annotations

from rlstream.common.config.consumer import (DYNAMIC_SAMPLING_LOSSES, CheckpointSettings, ConsumerSettings,
                                             LossName, LossSettings, OptimizerSettings, ParallelSettings,
                                             StressSettings, TrainerMemorySettings, WeightSyncSettings)
from rlstream.common.config.engine import EngineSettings, LogprobsMode, RoutingMode
from rlstream.common.config.harness import DemoSettings, ExperimentSettings
from rlstream.common.config.kafka import BrokerSettings, KafkaSettings, TopicSettings
from rlstream.common.config.load import (ENV_ALIASES, ENV_PREFIX, SECRET_KEYS, EnvAlias, RlstreamConfig,
                                         dump_config, load_config, set_path)
from rlstream.common.config.producer import (AgentEndpointSettings, EpisodeSettings, JournalSettings,
                                             JsonlPrompts, KafkaTopicPrompts, ProducerSettings,
                                             PromptSettings, ReasoningGymPrompts)
from rlstream.common.config.shared import (AutoStalenessSettings, CliSettings, ConsumerLivenessSettings,
                                           ControlSettings, HttpSettings, LivenessSettings, ModelSettings,
                                           ProducerLivenessSettings, StalenessSettings)

__all__ = [
    "DYNAMIC_SAMPLING_LOSSES", "ENV_ALIASES", "ENV_PREFIX", "SECRET_KEYS",
    "AgentEndpointSettings", "AutoStalenessSettings", "BrokerSettings", "CheckpointSettings", "CliSettings",
    "ConsumerLivenessSettings", "ConsumerSettings", "ControlSettings", "DemoSettings", "EngineSettings",
    "EnvAlias", "EpisodeSettings", "ExperimentSettings", "HttpSettings", "JournalSettings", "JsonlPrompts",
    "KafkaSettings", "KafkaTopicPrompts", "LivenessSettings", "LogprobsMode", "LossName", "LossSettings",
    "ModelSettings", "OptimizerSettings", "ParallelSettings", "ProducerLivenessSettings", "ProducerSettings",
    "PromptSettings", "ReasoningGymPrompts", "RlstreamConfig", "RoutingMode", "StalenessSettings",
    "StressSettings", "TopicSettings", "TrainerMemorySettings", "WeightSyncSettings",
    "dump_config", "load_config", "set_path",
]
