"""A service's machine-readable status file: where it serves, and how it ended.

Supervisors, the demo and the tests read this instead of parsing log lines.
A service given `run_file: PATH` (`producer.run_file`, `consumer.run_file`)
writes a JSON object there:

- at start, once its HTTP server is up: `role`, `pid`, `state: "running"`,
  `http_url`, `bootstrap`, `started_at`, plus role fields (the producer's
  `producer_id`; the consumer's `step` and `version`);
- at a clean stop: `state: "stopped"`, `stopped_at`, plus the final counters
  (the producer's `published`; the consumer's `outcomes`, `held`, `step`,
  `version`).

A service killed with SIGKILL leaves `state: "running"`: readers combine the
file with the process's liveness. Every write replaces the whole file
atomically (write a temporary file, fsync, rename), so a reader never sees half
of one.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def write_run_file(path: str | os.PathLike | None, fresh: bool = False, **fields: Any) -> None:
    """Merge `fields` into the JSON object at `path` (created if missing);
    `fresh` starts from an empty object (a new incarnation's start record).

    `path` None does nothing, so services call this unconditionally.
    """
    if path is None:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = {} if fresh else (read_run_file(p) or {})
    data.update(fields)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def read_run_file(path: str | os.PathLike) -> dict | None:
    """The status a service last wrote at `path`, or None if it wrote none yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def started(role: str, http_url: str, bootstrap: str, **fields: Any) -> dict[str, Any]:
    """The fields of the start record (see the module docstring)."""
    return {"role": role, "pid": os.getpid(), "state": "running", "http_url": http_url,
            "bootstrap": bootstrap, "started_at": time.time(), **fields}


def stopped(**fields: Any) -> dict[str, Any]:
    """The fields of the stop record."""
    return {"state": "stopped", "stopped_at": time.time(), **fields}
