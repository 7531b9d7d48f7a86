"""Every thread's Python stack on SIGUSR1, and the service goes on.

    kill -USR1 <pid>     # the service's stderr (journal, container log) gets:

    --- stacks of every thread (SIGUSR1), most recent call last ---
    Thread MainThread (140...):
      File ".../consumer/service.py", line 207, in run
      ...
    --- end of stacks ---

SIGUSR1 is blocked in the calling thread, and so in every thread started
after it, and one daemon thread takes it with `sigwait` and writes the stacks
holding the GIL: the stacks of threads blocked in a C call (a collective, a
Kafka fetch) are there, and no other thread is interrupted. Call it first
thing, before other threads start. A thread started before that (not blocking
the signal) may still take it: a Python handler then writes the stacks from
the main thread, so the signal never ends the process. `faulthandler`'s own
SIGUSR1 handler reads other threads' frames from the signal handler while they
run, which can crash the process; this does not.
"""
from __future__ import annotations

import signal
import sys
import threading
import traceback

BEGIN = "--- stacks of every thread (SIGUSR1), most recent call last ---"
END = "--- end of stacks ---"


def format_stacks() -> str:
    """Every thread's stack, the main thread first, between BEGIN and END."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    parts = [BEGIN]
    for ident in sorted(frames, key=lambda i: i != main):
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):")
        parts.append("".join(traceback.format_stack(frames[ident])).rstrip("\n"))
    parts.append(END)
    return "\n".join(parts) + "\n"


def write_stacks(*_) -> None:
    sys.stderr.write(format_stacks())
    sys.stderr.flush()


def dump_stacks_on_sigusr1() -> None:
    """Write every thread's stack to stderr on SIGUSR1, from a thread of its own."""
    signal.signal(signal.SIGUSR1, write_stacks)  # a thread that does not block it took it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    threading.Thread(target=_take_sigusr1, name="stack-dumper", daemon=True).start()


def _take_sigusr1() -> None:
    while True:
        signal.sigwait({signal.SIGUSR1})
        write_stacks()
