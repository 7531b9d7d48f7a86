"""Built-in environments for multi-turn episodes (`producer.episodes.env`; protocol in
producer/rollout/environment.py)."""
from __future__ import annotations

from collections.abc import Callable

from common.config import EpisodeSettings
from common.errors import ConfigError
from producer.envs.calculator import CalculatorEnv

ENVIRONMENTS: dict[str, Callable[[], object]] = {"calculator": CalculatorEnv}


def env_factory(settings: EpisodeSettings) -> Callable[[], object]:
    """A callable that makes one fresh environment per episode."""
    try:
        return ENVIRONMENTS[settings.env]
    except KeyError:
        raise ConfigError(f"unknown environment {settings.env!r}; one of {sorted(ENVIRONMENTS)}",
                          key="producer.episodes.env") from None
