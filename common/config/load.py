"""The whole file (`RlstreamConfig`) and its loading: file, declared `RLSTREAM_*`
aliases, RLSTREAM__SECTION__KEY variables, `--set` and flags, merged in that
order and validated once; errors name the dotted key. `dump_config` prints the
result with secrets masked."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError, model_validator

from rlstream.common.config.base import _Section
from rlstream.common.config.consumer import ConsumerSettings
from rlstream.common.config.harness import DemoSettings, ExperimentSettings
from rlstream.common.config.kafka import BrokerSettings, KafkaSettings
from rlstream.common.config.producer import ProducerSettings
from rlstream.common.config.shared import CliSettings, ModelSettings, StalenessSettings
from rlstream.common.errors import ConfigError

ENV_PREFIX = "RLSTREAM__"


class RlstreamConfig(_Section):
    """The whole deployment file. Each service reads its sections."""

    kafka: KafkaSettings = KafkaSettings()
    broker: BrokerSettings = BrokerSettings()
    model: ModelSettings = ModelSettings()
    staleness: StalenessSettings = StalenessSettings()
    producer: ProducerSettings = ProducerSettings()
    consumer: ConsumerSettings = ConsumerSettings()
    demo: DemoSettings = DemoSettings()
    cli: CliSettings = CliSettings()
    experiment: ExperimentSettings = ExperimentSettings()

    @model_validator(mode="after")
    def _groups_agree(self):
        if self.producer.group_size != self.consumer.group_size:
            raise ValueError(f"producer.group_size ({self.producer.group_size}) != "
                             f"consumer.group_size ({self.consumer.group_size})")
        return self


# ------------------------------------------------- environment variables

@dataclass(frozen=True)
class EnvAlias:
    """A declared `RLSTREAM_*` environment variable: a short name for `keys`."""

    name: str
    keys: tuple[str, ...]
    """Dotted settings it sets (to its value, verbatim)."""
    doc: str


ENV_ALIASES: tuple[EnvAlias, ...] = (
    EnvAlias("RLSTREAM_ADMIN_TOKEN", ("producer.http.admin_token", "consumer.http.admin_token", "cli.admin_token"),
             "The deployment's admin bearer token, for the services' admin API and `rlstream ctl`; "
             "keep it in the environment (a Kubernetes Secret, an env file), not in a config file."),
    EnvAlias("RLSTREAM_ADMIN_URL", ("cli.admin_url",), "The service `rlstream ctl` calls."),
    EnvAlias("RLSTREAM_LOG_LEVEL", ("cli.log_level",), "Log level of every rlstream process."),
    EnvAlias("RLSTREAM_GPU_STANDIN", (), "Tests and the cluster twin only: every process of the run "
             "replaces libnccl, CUDA streams and pinned memory by CPU stand-ins (common/gpu_standin/), so "
             "vLLM's nccl weight-transfer engine runs on CPU. Sets no setting; never set it on a GPU machine."),
)
"""Every `RLSTREAM_*` variable rlstream reads besides the generic RLSTREAM__SECTION__KEY form
(the harness's experiment knobs use the generic form). An empty value counts as unset."""

SECRET_KEYS = ("kafka.sasl_plain_password", "producer.http.admin_token", "consumer.http.admin_token",
               "cli.admin_token", "producer.agent_endpoint.token")
"""Settings `dump_config` (--dry-run) masks."""


# ---------------------------------------------------------------- loading

def set_path(tree: dict, dotted: str, value: Any, source: str = "an override") -> None:
    """`tree[a][b][c] = value` for `dotted` "a.b.c", creating sections; the one
    dotted-key setter (env, --set, and the harness's run configs use it)."""
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty key in {source}")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{p} is not a section ({source})", key=dotted)
        node = nxt
    node[parts[-1]] = value


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _alias_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) of every declared alias that is set."""
    return [(key, environ[a.name], f"environment {a.name}")
            for a in ENV_ALIASES if environ.get(a.name) for key in a.keys]


def _env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) of every RLSTREAM__SECTION__KEY variable, values as YAML scalars."""
    out = []
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX):
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append((dotted, _scalar(value), f"environment {name}"))
    return out


def _set_overrides(items: list[str]) -> list[tuple[str, Any, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out.append((k.strip(), _scalar(v), "--set"))
    return out


def _dotted_key(loc: tuple) -> str:
    """The dotted key of a pydantic error location. Inside a tagged union pydantic
    adds the member's tag as a step (`producer.prompts.kafka_topic.topic`); the
    key a user writes has none (`producer.prompts.topic`), so tag steps are dropped."""
    keys, node = [], RlstreamConfig
    for step in loc:
        members = {m.model_fields["type"].default: m for m in get_args(node)
                   if isinstance(m, type) and issubclass(m, BaseModel) and "type" in m.model_fields}
        if step in members:
            node = members[step]
            continue
        keys.append(str(step))
        fields = node.model_fields if isinstance(node, type) and issubclass(node, BaseModel) else {}
        node = fields[step].annotation if step in fields else None
    return ".".join(keys)


def _format_validation(e: ValidationError) -> ConfigError:
    lines = []
    first_key = None
    for err in e.errors():
        key = _dotted_key(err["loc"]) or "<root>"
        first_key = first_key or key
        msg = "unknown key (check spelling; see README 'Configuration')" if err["type"] == "extra_forbidden"\
            else err["msg"]
        lines.append(f"{key}: {msg}")
    return ConfigError("invalid configuration:\n  " + "\n  ".join(lines), key=None) if len(lines) > 1\
        else ConfigError(lines[0].split(": ", 1)[1], key=first_key)


def _read_file(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist (try configs/tiny-cpu.yaml)")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{p} must hold a mapping of sections")
    return tree


def _launch_context(environ: Mapping[str, str]) -> dict[str, Any]:
    """What the launcher tells the validators: torchrun's WORLD_SIZE (ParallelSettings)."""
    world = environ.get("WORLD_SIZE", "")
    return {"world_size": int(world)} if world.isdigit() and int(world) > 0 else {}


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                environ: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> RlstreamConfig:
    """File + declared aliases + env + `--set key=value` + flags -> validated RlstreamConfig.

    `flags`: {dotted key: value} of dedicated command-line flags, verbatim
    (None values are skipped). Raises ConfigError naming the offending key.
    """
    tree = _read_file(path)
    environ = os.environ if environ is None else environ
    layers = (_alias_overrides(environ) + _env_overrides(environ) + _set_overrides(overrides or [])
              + [(k, v, "command-line flag") for k, v in (flags or {}).items() if v is not None])
    for dotted, value, source in layers:
        set_path(tree, dotted, value, source)
    try:
        return RlstreamConfig.model_validate(tree, context=_launch_context(environ))
    except ValidationError as e:
        raise _format_validation(e) from None


def dump_config(cfg: RlstreamConfig) -> str:
    """The resolved config as YAML (for --dry-run). Secrets (SECRET_KEYS) are masked."""
    data = cfg.model_dump(mode="json")
    for dotted in SECRET_KEYS:
        *sections, key = dotted.split(".")
        node = data
        for name in sections:
            node = node[name] or {}  # an optional section that is off (None) holds no secret
        if node.get(key):
            node[key] = "***"
    return yaml.safe_dump(data, sort_keys=False)
