"""Bench smokes run two at a time, each exactly as a person runs it.

The smokes spend much of their wall time waiting (a fixed duration of
training, a watchdog's timeout, a service's start), so two of them share the
2 cores of a CI machine with little loss. `SmokePool` starts the jobs in the
order given, one per free lane; a test then waits for its own job. Because
jobs start in test order, by the time a test waits, every earlier job has
ended and its own job has started: a test waits at most its own job's run.

Jobs of one `group` never run at the same time (the experiment benches share
one warm start, which the first of them builds): a lane whose next job's
group is busy waits for it. Each job is its own process group, killed whole
at its timeout or when the pool stops.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.common.process import signal_group


@dataclass
class Job:
    name: str
    cmd: list[str]
    timeout_s: float
    group: str = ""


@dataclass
class Outcome:
    code: int | None = None
    """Exit code; None when the job ran past its timeout (then killed)."""
    out: str = ""
    err: str = ""
    seconds: float = 0.0
    started_at: float = 0.0
    """Seconds after the pool started."""
    done: threading.Event = field(default_factory=threading.Event)


def run_process_group(cmd: list[str], timeout_s: float, cwd: Path, env: dict,
                      on_start=None) -> tuple[int | None, str, str, float]:
    """(exit code or None on timeout, stdout, stderr, seconds); whatever the process group
    still runs afterwards (a bench's broker, engines and workers) is SIGKILLed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if on_start is not None:
        on_start(proc)
    code = None
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
    finally:
        _kill_group(proc)
    return code, out, err, time.monotonic() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    signal_group(proc, signal.SIGKILL)


class SmokePool:
    def __init__(self, jobs: list[Job], lanes: int, cwd: Path, env: dict):
        self.jobs = list(jobs)
        self.outcomes = {j.name: Outcome() for j in self.jobs}
        self.cwd, self.env = cwd, env
        self._next = 0
        self._busy_groups: set[str] = set()
        self._procs: dict[str, subprocess.Popen] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._t0 = time.monotonic()
        self._lanes = [threading.Thread(target=self._lane, name=f"smoke-lane-{i}", daemon=True)
                       for i in range(lanes)]
        for t in self._lanes:
            t.start()

    def wait(self, name: str, timeout_s: float) -> Outcome:
        """The job's outcome once it ended (TimeoutError if it has not within `timeout_s`)."""
        outcome = self.outcomes[name]
        if not outcome.done.wait(timeout_s):
            raise TimeoutError(f"{name} did not end within {timeout_s:.0f} s of waiting")
        return outcome

    def stop(self) -> None:
        """Start nothing more; kill what runs."""
        with self._cond:
            self._stopped = True
            procs = list(self._procs.values())
            self._cond.notify_all()
        for p in procs:
            _kill_group(p)
        for t in self._lanes:
            t.join(timeout=30)

    def _take(self) -> Job | None:
        with self._cond:
            while not self._stopped and self._next < len(self.jobs):
                job = self.jobs[self._next]
                if not job.group or job.group not in self._busy_groups:
                    self._next += 1
                    if job.group:
                        self._busy_groups.add(job.group)
                    return job
                self._cond.wait(1.0)
            return None

    def _lane(self) -> None:
        while (job := self._take()) is not None:
            outcome = self.outcomes[job.name]
            outcome.started_at = time.monotonic() - self._t0

            def started(proc, name=job.name):
                with self._cond:
                    self._procs[name] = proc
                    if self._stopped:
                        _kill_group(proc)

            try:
                outcome.code, outcome.out, outcome.err, outcome.seconds = run_process_group(
                    job.cmd, job.timeout_s, self.cwd, self.env, on_start=started)
            except Exception as e:  # noqa: BLE001 - the test reports it instead of hanging
                outcome.err = f"the pool could not run {job.cmd}: {e!r}"
                outcome.code = -1
            finally:
                with self._cond:
                    self._procs.pop(job.name, None)
                    self._busy_groups.discard(job.group)
                    self._cond.notify_all()
                outcome.done.set()
