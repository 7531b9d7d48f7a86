"""Weight reload: serve an announced policy version, never half of one.

`Reloader.apply(msg: WeightsReady) -> bool` is the whole contract; the
service calls it between two engine steps (one thread drives both, so no
forward ever sees a half-loaded model). For a version newer than the one
served it:

1. stages the version: hard links (a copy across file systems) into one of
   two private slots, `a` and `b`, the one not being served, so the
   consumer pruning its weight store cannot pull files from under a load;
2. verifies the staged copy (size and sha256 of model.safetensors), so what
   is checked is exactly what is loaded;
3. reloads the engine in place from the slot.

A version that fails 1 or 2 is refused: the engine keeps serving what it
served, the failure is logged and counted
(`rlstream_producer_weight_reload_failures_total`), and `apply` returns
False. A load that fails halfway (3) is counted too and rolled back by
reloading the previous version from its own slot (or the base model
directory); if that fails as well the weights are inconsistent and
`WeightReloadError` tells the service to exit so a supervisor restarts it.

The transport is a seam: today the announcement carries a file:// URI into
the weight store (common/weights/store.py); another transport only changes
how step 1 gets the files.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Protocol

from common.control.messages import WeightsReady
from common.errors import WeightReloadError
from producer import telemetry

log = logging.getLogger("rlstream.producer")


class ReloadableEngine(Protocol):
    """What the reloader needs of `producer.engine.RolloutEngine`."""

    version: int

    def reload_weights(self, weights_dir: str | Path, version: int) -> float: ...


class Reloader:
    """Stages, verifies and loads announced versions into `engine`, which serves
    `base_dir` (the model directory) until the first reload."""

    def __init__(self, engine: ReloadableEngine, base_dir: str | Path):
        self.engine = engine
        self.loaded = Path(base_dir)  # what the engine serves now
        self.stage_root = Path(tempfile.mkdtemp(prefix="rlstream-weights-"))

    def apply(self, msg: WeightsReady) -> bool:
        """Serve `msg.version` if it is newer and verifies; True when the engine now serves it."""
        if msg.version <= self.engine.version:
            return False
        t0 = time.perf_counter()
        staged = self._stage_and_verify(msg)
        if staged is None:
            return False
        try:
            self.engine.reload_weights(staged, msg.version)
        except Exception:  # noqa: BLE001 - any load failure is rolled back
            telemetry.RELOAD_FAILURES.inc()
            self._restore_loaded()
            return False
        self.loaded = staged
        telemetry.RELOAD_SECONDS.observe(time.perf_counter() - t0)
        telemetry.VERSION.set(self.engine.version)
        return True

    def _stage_and_verify(self, msg: WeightsReady) -> Path | None:
        """The staged, verified copy of `msg`'s version, or None (refused, logged, counted)."""
        from common.weights.store import stage_version, verify

        slot = self.stage_root / ("a" if self.loaded != self.stage_root / "a" else "b")  # not what is loaded
        try:
            staged = stage_version(msg.uri, slot)
            verify(staged.as_uri(), msg.sha256, msg.bytes)
        except Exception as e:  # noqa: BLE001 - a bad version must never take the service down
            telemetry.RELOAD_FAILURES.inc()
            log.error("refusing weight version %d: %s (still serving version %d)",
                      msg.version, e, self.engine.version)
            return None
        return staged

    def _restore_loaded(self) -> None:
        """A load failed halfway: reload what was serving, or raise (never serve half a model)."""
        log.exception("loading a verified version failed; restoring version %d", self.engine.version)
        try:
            self.engine.reload_weights(self.loaded, self.engine.version)
        except Exception as e:  # noqa: BLE001 - whatever failed, the weights are now inconsistent
            raise WeightReloadError(f"weights are inconsistent after a failed reload and restoring "
                                    f"{self.loaded} failed too ({e}); exiting so a supervisor restarts us") from e

    def close(self) -> None:
        shutil.rmtree(self.stage_root, ignore_errors=True)
