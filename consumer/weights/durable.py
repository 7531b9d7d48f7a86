"""The durable weight store on the collective path: written in the background.

    durable = DurableWriter(store, model_dir, every=K)   # store: common/weights/store.py WeightStore
    durable.maybe_write(snapshot)    # when version % K == 0, on the writer's thread
    durable.flush(snapshot)          # at shutdown: the last version, waited for
    durable.newest                   # the newest complete copy (announced as WeightsReady.durable_*)

It keeps the store current enough for producers that start late, restart or
miss a transfer (producer/weights/reload.py falls back to it), without a per-version
write on the training path (safetensors + fsync + sha256 of the whole model).
One write at a time; a version due while one is being written waits, replaced
by any newer one. `snapshot` is consumer/weights/snapshot.py's `Snapshot` (anything
with `version`, `tensors()`, `acquire()`, `release()`); held while written, so
its buffers are not reused under the writer.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from rlstream.common.control.messages import DurableCopy
from rlstream.common.weights.store import MANIFEST
from rlstream.consumer import telemetry

if TYPE_CHECKING:
    from rlstream.consumer.weights.snapshot import Snapshot

log = logging.getLogger("rlstream.consumer")


class DurableWriter:
    """Background writes of snapshots to the durable store (see the module doc)."""

    def __init__(self, store, base_dir: str, every: int):
        self.store, self.base_dir, self.every = store, base_dir, every
        self.newest: DurableCopy | None = _newest_in(store)
        """The newest complete durable copy (announced as durable_*)."""
        self._pending: Snapshot | None = None
        self._cond = threading.Condition()
        self._busy = self._stop = False
        self._thread = threading.Thread(target=self._run, name="rlstream-durable-writer", daemon=True)
        self._thread.start()
        if self.newest is not None:
            telemetry.DURABLE_VERSION.set(self.newest.version)

    def maybe_write(self, snap: Snapshot) -> None:
        """Write `snap` in the background if its version is due (version % K == 0)."""
        if snap.version % self.every == 0:
            self._enqueue(snap)

    def flush(self, snap: Snapshot | None, timeout_s: float = 600.0) -> None:
        """At shutdown: make `snap` (the last version) durable, waiting for the writer."""
        if snap is not None and (self.newest is None or self.newest.version < snap.version):
            self._enqueue(snap)
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and not self._busy, 600)
            self._stop = True
            self._cond.notify_all()

    def _enqueue(self, snap: Snapshot) -> None:
        with self._cond:
            if self._pending is not None:
                self._pending.release()
            self._pending = snap.acquire()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._stop)
                if self._pending is None:
                    return
                snap, self._pending, self._busy = self._pending, None, True
            try:
                self._write(snap)
            except Exception:  # noqa: BLE001 - the next due version tries again; the links go on
                log.exception("durable write of version %d failed", snap.version)
            finally:
                snap.release()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        m = self.store.write(snap.version, snap.tensors(), self.base_dir)
        self.newest = DurableCopy(snap.version, m["uri"], m["sha256"], m["bytes"])
        telemetry.DURABLE_VERSION.set(snap.version)
        log.info("durable copy of version %d written in %.1f s", snap.version, time.perf_counter() - t0)


def _newest_in(store) -> DurableCopy | None:
    """The newest complete version already in the store (a restarted consumer's)."""
    for v in reversed(store.versions()):
        try:
            m = json.loads((store.path(v) / MANIFEST).read_text())
            return DurableCopy(int(m["version"]), m["uri"], m["sha256"], int(m["bytes"]))
        except (OSError, ValueError, KeyError):
            continue
    return None
