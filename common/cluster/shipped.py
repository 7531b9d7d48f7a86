"""The shipped deployment files, read as their orchestrator would run them.

A rehearsal on the cluster twin must run what users deploy, not a copy of it:
these functions take the commands and environments straight from
ops/compose/docker-compose.yml (merge keys and `${VAR:-default}` interpolation
resolved as Docker Compose does) and from the systemd units (ExecStart,
Environment=, EnvironmentFile=), so a test that starts them runs the same
command lines with the same settings.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class ShippedService:
    """One service of a shipped deployment file."""

    name: str
    command: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's interpolation: $$ -> $, ${V}, $V, ${V:-default}, ${V-default},
    ${V:?error} (ValueError when V is unset or empty)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        value, op, arg = variables.get(name), m.group(2), m.group(3)
        if op in (":-", "-"):
            return value if (value if op == ":-" else value is not None) else arg
        if op in (":?", "?") and not value:
            raise ValueError(f"{name}: {arg}")
        return value or ""
    return _VAR.sub(sub, text)


def compose_services(path: str | Path, variables: dict[str, str]) -> dict[str, ShippedService]:
    """The services of a compose file (those with a `command`), interpolated with `variables`."""
    doc = yaml.safe_load(Path(path).read_text())  # PyYAML resolves anchors and `<<` merge keys
    out = {}
    for name, svc in (doc.get("services") or {}).items():
        if "command" not in svc:
            continue
        cmd = svc["command"]
        argv = [interpolate(str(a), variables) for a in cmd] if isinstance(cmd, list) \
            else shlex.split(interpolate(cmd, variables))
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        out[name] = ShippedService(name, argv, {k: interpolate(str(v), variables) for k, v in env.items()},
                                   svc.get("working_dir"))
    return out


def systemd_service(path: str | Path, env_files: dict[str, str] | None = None) -> ShippedService:
    """A systemd unit's ExecStart and environment. `env_files` maps an
    EnvironmentFile= path to its text (the operator's file, which is not shipped)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    svc = sections.get("Service", {})
    env: dict[str, str] = {}
    for f in svc.get("EnvironmentFile", []):
        text = (env_files or {}).get(f.lstrip("-"))
        if text is None and not f.startswith("-"):
            raise FileNotFoundError(f"{path}: EnvironmentFile {f} is required; pass its text in env_files")
        for line in (text or "").splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, _, v = line.partition("=")
                env[k.strip()] = v.strip().strip('"')
    for assignment in svc.get("Environment", []):
        for kv in shlex.split(assignment):
            k, _, v = kv.partition("=")
            env[k] = v
    exec_start = svc.get("ExecStart", [""])[-1].lstrip("-@+!:")
    argv = [interpolate(a, env) for a in shlex.split(exec_start)]  # systemd expands ${VAR} from the unit's env
    return ShippedService(Path(path).stem, argv, env, (svc.get("WorkingDirectory") or [None])[-1])
