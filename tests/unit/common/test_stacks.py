"""SIGUSR1 writes every thread's stack and the process goes on (common/stacks.py)."""
from __future__ import annotations

import subprocess
import sys

from rlstream.common import stacks

PROGRAM = r"""
import os, signal, threading, time
from rlstream.common.stacks import dump_stacks_on_sigusr1

dump_stacks_on_sigusr1()

def blocked_in_c():
    time.sleep(60)

def churn(stop):
    while not stop.is_set():  # threads start and end while stacks are written
        t = threading.Thread(target=sum, args=(range(1000),))
        t.start()
        t.join()

stop = threading.Event()
threading.Thread(target=blocked_in_c, name="sleeper", daemon=True).start()
threading.Thread(target=churn, args=(stop,), name="churn", daemon=True).start()
for _ in range(100):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
stop.set()
print("still here", flush=True)
"""


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "still here\n"
    dumps = [d.split(stacks.END)[0] for d in out.stderr.split(stacks.BEGIN)[1:]]
    assert len(dumps) >= 50, out.stderr[-3000:]  # signals sent while one is written merge into one
    for d in dumps:
        threads = d.strip("\n").split("\nThread ")
        assert threads[0].startswith("Thread MainThread ("), d  # the main thread first
        sleeper = [t for t in threads if t.startswith("sleeper (")]
        assert sleeper and "in blocked_in_c" in sleeper[0], d  # a thread blocked in a C call is there
