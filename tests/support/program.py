"""A test's own program (an agent, a client, a stand-in trainer) run as a harness Service.

    agent = Program([sys.executable, "-m", "tests.support.calc_agent", ...], tmp_path, name="agent").start()
    wait_until(lambda: "ready" in agent.lines(), 60, "the agent to start", [agent])
    assert agent.wait(120) == 0, agent.log_tail()

`Service` (ops/harness/supervisor.py) runs `rlstream <command>`; a Program runs any argv
the same way: its own process group that dies with the test (common/process.py), stdout
and stderr in `<log_dir>/<name>.<n>.log`, `stop` / `kill` / `wait` (which kills the
group after its timeout), and the attributes `wait_until` watches to notice it died.
The environment is the services' (`child_env`: explicit thread counts, offline) with the
repository on PYTHONPATH, so `-m tests....` runs whatever the working directory.
"""
from __future__ import annotations

import os
from pathlib import Path

from rlstream.harness.supervisor import Service, child_env

ROOT = Path(__file__).resolve().parents[2]


class Program(Service):
    """`argv` as a Service: started by `start()`, killed with its group on leaving a `with`."""

    def __init__(self, argv: list[str], log_dir: str | os.PathLike, *, name: str, threads: int = 1,
                 env: dict[str, str] | None = None):
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        super().__init__("program", os.devnull, log_dir, name=name,
                         env=child_env(threads, {"PYTHONPATH": path, **(env or {})}))
        self.program_argv = list(argv)

    def argv(self) -> list[str]:
        return list(self.program_argv)

    def lines(self) -> list[str]:
        """The lines of the current incarnation's log so far (stdout and stderr)."""
        return self.log_text().splitlines()
