"""common/process.py: children in their own process group, stopped or killed as a group."""
from __future__ import annotations

import os
import signal
import sys
import time

from rlstream.common import process

# a leader that forks a worker (like vLLM), prints both pids, and exits 0 on SIGTERM
LEADER = """
import os, signal, sys, time
worker = os.fork()
if worker == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only a group SIGKILL ends it
    time.sleep(600)
    os._exit(0)
print(os.getpid(), worker, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if IGNORE:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


def _start(tmp_path, ignore_term: bool = False):
    log = tmp_path / "logs" / "leader.log"
    proc = process.spawn([sys.executable, "-c", f"IGNORE = {int(ignore_term)}\n" + LEADER], log)
    deadline = time.monotonic() + 30
    while not log.read_text().strip():
        assert time.monotonic() < deadline, "the child printed nothing"
        time.sleep(0.05)
    leader, worker = map(int, log.read_text().split())
    return proc, leader, worker, log


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (not reaped: its parent is gone) counts as gone
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_leads_its_own_group_and_kill_group_ends_its_workers(tmp_path):
    proc, leader, worker, _ = _start(tmp_path)
    assert leader == proc.pid and os.getpgid(worker) == proc.pid != os.getpgid(0)
    assert process.kill_group(proc) == -signal.SIGKILL
    assert _gone(worker)


def test_stop_is_sigterm_to_the_leader_then_no_worker_is_left(tmp_path):
    proc, _, worker, _ = _start(tmp_path)
    code, killed = process.stop(proc, timeout_s=30)
    assert (code, killed) == (0, False)
    assert _gone(worker)


def test_stop_kills_the_group_after_the_timeout(tmp_path):
    proc, _, worker, _ = _start(tmp_path, ignore_term=True)
    t0 = time.monotonic()
    code, killed = process.stop(proc, timeout_s=0.5)
    assert killed and code == -signal.SIGKILL and time.monotonic() - t0 < 20
    assert _gone(worker)


def test_signals_to_a_finished_child_are_harmless(tmp_path):
    proc = process.spawn([sys.executable, "-c", "print('done')"], tmp_path / "x.log")
    assert proc.wait(30) == 0
    process.signal_group(proc, signal.SIGKILL)
    assert process.stop(proc, 1) == (0, False)


def test_log_tail(tmp_path):
    assert process.log_tail(tmp_path / "missing.log") == "<no log>"
    assert process.log_tail(None) == "<no log>"
    p = tmp_path / "a.log"
    p.write_text("x" * 5000 + "\nlast line\n")
    assert process.log_tail(p, 20).endswith("last line") and len(process.log_tail(p, 20)) <= 20
    p.write_text("")
    assert process.log_tail(p) == "<empty log>"


def test_group_rss_counts_the_group(tmp_path):
    proc, _, _, _ = _start(tmp_path)
    try:
        assert process.group_rss_bytes(proc.pid) > 1 << 20
    finally:
        process.kill_group(proc)
    assert process.group_rss_bytes(proc.pid) == 0
