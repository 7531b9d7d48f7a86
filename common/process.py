"""Child processes that cannot outlive their parent: spawn, signal, stop, read the log.

One place for what the embedded broker (common/kafka/broker.py), the harness
supervisor (ops/harness/supervisor.py) and the tests do with processes:

- `spawn` starts a command with stdin closed and stdout + stderr in one log
  file. By default the child leads its own process group (so one signal
  reaches it and every worker it forks, e.g. vLLM's) and, on Linux, receives
  SIGTERM when the thread that spawned it dies (PR_SET_PDEATHSIG): a killed
  test run or demo leaves nothing behind.
- `signal_group` / `kill_group` signal the whole group; a group that is
  already gone is not an error.
- `stop` (= `terminate` + `wait_or_kill`) is the graceful path: SIGTERM to
  the leader only (it shuts down its own children), wait, then SIGKILL the
  whole group after the timeout; any member still alive after the leader
  exited is killed too.
- `log_tail` is the end of a log for error messages; `group_rss_bytes` the
  resident memory of a group (benchmarks).

Nothing here reads what a service logs: state comes from its run file
(common/runfile.py) and its /metrics.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

try:  # loaded now, not in the child: nothing may import between fork and exec
    import ctypes
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent_hook():
    """A preexec_fn for subprocess.Popen: SIGTERM when the spawning thread exits (None off Linux)."""
    return _die_with_parent if _LIBC is not None else None


def spawn(argv: list[str], log_path: str | os.PathLike, env: dict[str, str] | None = None, *,
          own_group: bool = True, die_with_parent: bool = True) -> subprocess.Popen:
    """Start `argv` with stdout and stderr appended to `log_path` (created with its folder).

    `own_group`: the child leads a new session and process group (its pid is the
    group id). `die_with_parent`: Linux sends it SIGTERM when the spawning
    thread exits (a no-op elsewhere).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preexec = _die_with_parent if die_with_parent and _LIBC is not None else None
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=own_group, preexec_fn=preexec)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to every process in `proc`'s group; to `proc` alone if it leads none
    (spawned without own_group). A group that is gone is fine."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        if proc.poll() is None:  # alive, so its pid is still its own: it leads no group
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
    except PermissionError:
        pass


def kill_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGKILL the whole group, then reap the leader; its exit code (-9 when it was alive)."""
    signal_group(proc, signal.SIGKILL)
    return proc.wait(timeout_s)


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to the leader only: a service shuts down its own children."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """Wait `timeout_s` for the leader, then SIGKILL the group.

    Returns (exit code, whether it had to be killed). Members of the group
    still alive after the leader exited are killed: a stopped service leaves
    no worker behind.
    """
    killed = False
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        killed = True
        code = kill_group(proc)
    signal_group(proc, signal.SIGKILL)
    return code, killed


def stop(proc: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """`terminate` then `wait_or_kill`: the graceful stop."""
    terminate(proc)
    return wait_or_kill(proc, timeout_s)


def log_tail(path: str | os.PathLike | None, max_bytes: int = 4000) -> str:
    """The last `max_bytes` of a log as text ("<no log>" when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except (OSError, TypeError):
        return "<no log>"
    return data.decode("utf-8", "replace").strip() or "<empty log>"


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def group_rss_bytes(pgid: int) -> int:
    """Summed resident memory of every process in group `pgid` (Linux /proc; 0 when gone)."""
    total = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    total += _rss_bytes(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return total
