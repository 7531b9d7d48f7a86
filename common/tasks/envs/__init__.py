"""Built-in environments for multi-turn episodes (`producer.episodes.env`; protocol in
common/tasks/environment.py)."""
from __future__ import annotations

from collections.abc import Callable

from rlstream.common.config import EpisodeSettings
from rlstream.common.errors import ConfigError
from rlstream.common.tasks.envs.calculator import CalculatorEnv

ENVIRONMENTS: dict[str, Callable[[], object]] = {"calculator": CalculatorEnv}


def env_factory(settings: EpisodeSettings) -> Callable[[], object]:
    """A callable that makes one fresh environment per episode."""
    try:
        return ENVIRONMENTS[settings.env]
    except KeyError:
        raise ConfigError(f"unknown environment {settings.env!r}; one of {sorted(ENVIRONMENTS)}",
                          key="producer.episodes.env") from None
