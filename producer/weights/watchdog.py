"""A bound on a blocking weight transfer that stops making progress.

    with Watchdog(timeout_s, abort=communicator.destroy, what="nccl update") as dog:
        for name, t in received:      # blocks inside the transport
            dog.beat()                # progress: the bound restarts
    # no beat for timeout_s: `abort()` ran on the watchdog's thread, which makes the
    # blocked call fail; leaving the block then raises WeightTransferError saying so

A trainer that dies mid-transfer (any trainer rank failing restarts the whole
job) leaves the producer's workers blocked in the transport. vLLM's PyNccl
has no timeout: without an abort the worker waits forever while the engine's
loop is wedged in `collective_rpc` (review gpu-path-2, N6). The nccl update runs
under this watchdog (producer/weights/verified_update.py), so a dead trainer's
transfer ends within `producer.engine.weight_transfer_timeout_s` plus the abort
(vLLM's `destroy` waits at most 5 s for ncclCommAbort), and the failed update
is restored by the reloader (producer/weights/reload.py).

Gloo does not need it and could not use it: every op of a link is bounded by
its group timeout (common/weights/link.py `GlooPair`), and shutting a gloo
group down from another thread does not end a receive blocked in it (tried on
torch's ProcessGroupGloo: `shutdown()` returned at once, the blocked wait
ended only at its own 30 s timeout, and the process aborted at exit).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from common.errors import WeightTransferError

log = logging.getLogger("rlstream.producer")


class Watchdog:
    def __init__(self, timeout_s: float, abort: Callable[[], None], what: str = "weight transfer"):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.abort, self.what = timeout_s, abort, what
        self.fired = False
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rlstream-weights-watchdog", daemon=True)

    def beat(self) -> None:
        self._last = time.monotonic()

    def __enter__(self) -> "Watchdog":
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._done.set()
        self._thread.join()
        if self.fired:  # whatever the blocked call raised, the cause is the missing progress
            raise WeightTransferError(f"{self.what}: no progress for {self.timeout_s:.0f} s (a dead or hung "
                                      "trainer?); the transport was aborted") from exc

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self._last > self.timeout_s:
                self.fired = True
                log.error("%s made no progress for %.0f s; aborting it", self.what, self.timeout_s)
                try:
                    self.abort()
                except Exception:  # noqa: BLE001 - the abort is best effort; the caller raises anyway
                    log.exception("aborting %s failed", self.what)
                return
