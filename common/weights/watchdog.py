"""A bound on a blocking NCCL weight transfer that stops making progress, on either side.

    with Watchdog(timeout_s, abort=lambda: abort_nccl(comm), what="nccl update") as dog:
        for name, t in tensors:       # blocks inside the transport
            dog.beat()                # progress: the bound restarts
    # no beat for timeout_s: `abort()` ran on the watchdog's thread, which makes the
    # blocked call fail; leaving the block then raises WeightTransferError saying so

NCCL has no timeout: a collective whose peer died or hangs never returns, and vLLM's
PyNccl does not poll NCCL's asynchronous errors. On the producer a dead trainer would
leave the worker blocked and the engine loop wedged in `collective_rpc`
(producer/weights/worker/verified_update.py); on the trainer a dead producer would leave the
sender in the packed broadcast for ever, on vLLM's two cached streams, so every later
transfer would queue behind it (consumer/weights/nccl.py `NcclTrainer.send`). Both run
under this watchdog: the transfer ends within the bound plus the abort.

Gloo does not need it and could not use it: every op of a link is bounded by its
group timeout (common/weights/link.py `GlooPair`), and shutting a gloo group down from
another thread does not end a receive blocked in it (tried on torch's
ProcessGroupGloo: `shutdown()` returned at once, the blocked wait ended only at its
own 30 s timeout, and the process aborted at exit).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from rlstream.common.errors import WeightTransferError

log = logging.getLogger("rlstream.weights")

ABORT_JOIN_S = 5.0
"""How long an abort is waited for (vLLM's `destroy` waits as long: ncclCommAbort can
block until CUDA graphs that captured the communicator are released)."""


class Watchdog:
    """`abort()` once no `beat()` came for `timeout_s`, or at once when `errored()` (polled with
    the bound: at most every second) says the transport failed (NCCL's asynchronous error)."""

    def __init__(self, timeout_s: float, abort: Callable[[], None], what: str = "weight transfer",
                 errored: Callable[[], int] = lambda: 0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.abort, self.what, self.errored = timeout_s, abort, what, errored
        self.fired = False
        self.why = ""
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
        if self.fired:  # whatever the blocked call raised, the cause is the one the watchdog saw
            raise WeightTransferError(f"{self.what}: {self.why}; the transport was aborted") from exc

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self._last > self.timeout_s:
                self._fire(f"no progress for {self.timeout_s:.0f} s (a dead or hung peer?)")
                return
            if code := self._error():
                self._fire(f"the transport reported an error (NCCL {code}: a peer's connection was lost)")
                return

    def _error(self) -> int:
        try:
            return self.errored()
        except Exception:  # noqa: BLE001 - a failing poll is not a failed transfer
            return 0

    def _fire(self, why: str) -> None:
        self.fired, self.why = True, why
        log.error("%s: %s; aborting it", self.what, why)
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - the abort is best effort; the caller raises anyway
            log.exception("aborting %s failed", self.what)


def nccl_async_error(comm) -> int:
    """NCCL's asynchronous error of vLLM's PyNcclCommunicator `comm` (ncclCommGetAsyncError),
    0 when there is none, the communicator is gone, or the library lacks the symbol. A peer
    whose connection is lost shows here: the collective waiting on it never returns (vLLM's
    binding does not expose the symbol: it is called on the library itself)."""
    import ctypes

    if comm is None or getattr(comm, "disabled", True):
        return 0
    fn = getattr(getattr(comm.nccl, "lib", None), "ncclCommGetAsyncError", None)
    if fn is None:
        return 0
    result = ctypes.c_int(0)
    rc = fn(comm.comm, ctypes.byref(result))
    return int(result.value) if rc == 0 else 0


def abort_nccl(comm) -> None:
    """Abort vLLM's PyNcclCommunicator `comm` (ncclCommAbort), marking it disabled first.

    vLLM's own `destroy()` sets `disabled` only after it joined the abort thread (up to
    5 s): in that window a thread the abort released from its collective goes on to the
    next one (the packed receive loops over its chunks) and calls NCCL on a communicator
    being aborted. Disabled first, every later call on it returns at once (vLLM's check)."""
    if comm is None or not getattr(comm, "available", False) or comm.disabled:
        return
    comm.disabled, comm.available = True, False
    nccl, handle, index = comm.nccl, comm.comm, comm.device.index

    def run() -> None:
        import torch

        with torch.accelerator.device_index(index):
            nccl.ncclCommAbort(handle)
    t = threading.Thread(target=run, name="rlstream-nccl-abort", daemon=True)
    t.start()
    t.join(ABORT_JOIN_S)
