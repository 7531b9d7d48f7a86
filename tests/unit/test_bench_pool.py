"""The smoke pool (tests/support/bench_pool.py) on small shell commands: start order,
lanes, one job of a group at a time, timeouts and stop kill whole process groups."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.support.bench_pool import Job, SmokePool

ENV = dict(os.environ)


def sleeper(name: str, seconds: float, group: str = "", timeout_s: float = 30.0) -> Job:
    return Job(name, [sys.executable, "-c", f"import time; time.sleep({seconds}); print('{name}')"], timeout_s, group)


def test_two_lanes_start_jobs_in_order_and_run_two_at_once(tmp_path):
    pool = SmokePool([sleeper("a", 1.0), sleeper("b", 1.0), sleeper("c", 0.1)], 2, tmp_path, ENV)
    try:
        a, b, c = (pool.wait(n, 30) for n in "abc")
    finally:
        pool.stop()
    assert (a.code, a.out.strip(), b.code, c.code) == (0, "a", 0, 0)
    assert b.started_at < 0.8 * a.seconds  # b did not wait for a
    assert c.started_at >= min(a.seconds, b.seconds) * 0.9  # c waited for a free lane


def test_jobs_of_one_group_never_overlap(tmp_path):
    pool = SmokePool([sleeper("a", 1.0, "g"), sleeper("b", 0.1, "g"), sleeper("c", 0.1)], 2, tmp_path, ENV)
    try:
        a, b, _ = (pool.wait(n, 30) for n in "abc")
    finally:
        pool.stop()
    assert b.started_at >= a.started_at + a.seconds * 0.9


def test_a_job_past_its_timeout_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f" open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    pool = SmokePool([Job("hang", [sys.executable, "-c", script], 2.0)], 1, tmp_path, ENV)
    try:
        t0 = time.monotonic()
        run = pool.wait("hang", 30)
    finally:
        pool.stop()
    assert run.code is None and time.monotonic() - t0 < 20
    _gone(int(marker.read_text()))


def test_stop_kills_what_runs_and_starts_nothing_more(tmp_path):
    pool = SmokePool([sleeper("a", 60), sleeper("b", 0.1)], 1, tmp_path, ENV)
    time.sleep(0.5)
    t0 = time.monotonic()
    pool.stop()
    assert time.monotonic() - t0 < 10
    assert pool.outcomes["a"].done.is_set() and pool.outcomes["a"].code != 0
    assert not pool.outcomes["b"].done.is_set()


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} still runs")
