"""Waits that follow progress, not a wall clock sized for a quiet machine.

    wait_until(lambda: steps() >= 4, 180, "consumer steps", [c, p], progress=working(c, p))

With `progress`, `wait_until`'s timeout bounds the time WITHOUT progress (common/
harness/supervisor.py): a loaded machine makes a service slow, not stuck. `working(*services)`
is progress as CPU: it changes each time the services' process groups (a service and the
processes it started: vLLM's engine core, torchrun's ranks) have used another `cpu_s` seconds
of CPU between them. A service doing its work (starting, training, generating) uses CPU even
on a machine at load 15; one that is stuck (a deadlock, waiting on what never comes) uses next
to none, and a poll loop waiting on Kafka uses ~1-3 % of a core, far below `cpu_s` per stall
window, so a wait for what never comes still ends. The test's pytest-timeout bounds the whole.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in group `pgid` (Linux /proc)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ... utime (12), stime (13)
            total += int(fields[11]) + int(fields[12])
    return total * TICK_S


def working(*services, cpu_s: float = 2.0) -> Callable[[], int]:
    """Progress of `services` (harness Services, or process group ids): their CPU seconds, in
    steps of `cpu_s`."""
    def pgids() -> list[int]:
        return [s if isinstance(s, int) else s.pid for s in services if isinstance(s, int) or s.alive]

    return lambda: int(sum(group_cpu_seconds(g) for g in pgids()) // cpu_s)


def run_to_exit(argv: list[str], env: dict[str, str], stall_s: float = 180.0,
                cpu_s: float = 2.0) -> tuple[int, str]:
    """Run `argv` in a process group of its own until it exits: (exit code, its stderr and stdout).
    Killed (with everything it started) once it has made no progress (`working`) for `stall_s`,
    then AssertionError with the tail of its output."""
    import tempfile
    import time

    from rlstream.common import process

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.log"
        proc = process.spawn(argv, out, env)
        progress = working(proc.pid, cpu_s=cpu_s)
        mark, deadline = progress(), time.monotonic() + stall_s
        while proc.poll() is None:
            if (now := progress()) != mark:
                mark, deadline = now, time.monotonic() + stall_s
            if time.monotonic() > deadline:
                process.kill_group(proc, timeout_s=10)
                raise AssertionError(f"{argv[:3]} made no progress for {stall_s:.0f} s; output tail:\n"
                                     f"{out.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        return proc.returncode, out.read_text(errors="replace")
