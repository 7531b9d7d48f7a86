"""Weight reload: serve announced policy versions, never half of one.

    reloader.apply(msg)     # each new WeightsReady (the newest of a control poll)
    reloader.tick()         # every loop iteration, between two engine steps
    reloader.catch_up(msg)  # at start: before generating

The service calls all three between engine steps from its one thread, so no
forward ever sees a half-loaded model. Two ways in (docs/weights.md):

Collective (`transport: collective`): the producer keeps a link to the
trainer's endpoint (producer/weights/trainer_link.py), the one control channel of
each version: the trainer starts it, streams it and finishes it with the digest of
what it sent. On `rlstream_gloo` vLLM's weight-transfer engine receives it in the
background while the engine keeps stepping and checks every group's digest in band
(producer/weights/worker/gloo_engine.py); with vLLM's `nccl` engine the link's update loads
it at once, folding a device digest as it goes (producer/weights/worker/verified_update.py).
Either way `tick` serves it only if the received digest equals the trainer's
(`digest_refusal`, the one comparison), else refuses it (gloo: the staging is
dropped, nothing was touched; nccl: what was served is restored), and the link
answers the trainer's finish with the decision. The announcement (WeightsReady)
says where the endpoint is, which version is newest (the overdue timer) and where
its durable copy is. A late or restarted producer registers and the trainer sends
it the current version at once.

Durable (`transport: file`, and the fallback): the version's directory in the
weight store is staged (hard links, a copy across file systems) into one of
two private slots, `a` and `b` (the one not being served), its size and
sha256 verified, then reloaded in place.

Failures, by kind:
- refused (digest or sha256 mismatch, missing files): the engine keeps
  serving what it served, `rlstream_producer_weight_reload_failures_total`
  rises (the alert's metric), and a collective version falls back to the
  newest durable copy if that is newer than what is served;
- a link that broke or timed out (a dead or hung trainer): counted in
  `rlstream_producer_weight_transfer_failures_total`; the link is
  re-registered, and a version not received within
  `producer.engine.weight_transfer_timeout_s` of its announcement is taken
  from the durable store when a newer copy is there;
- a load that fails halfway, or an nccl update refused after it loaded (its
  digest, a failure while loading, no finish, a dead trainer the watchdog
  aborted): counted and rolled back before the next step by reloading the
  previous durable version from its slot (or the base model directory, or
  the newest durable copy); if that fails too the weights are inconsistent
  and `WeightReloadError` tells the service to exit so a supervisor restarts it.

`state()` is the weight state /healthz and /readyz show: serving, receiving,
restoring, or failed with the last refused version and why.
"""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from rlstream.common.control.messages import DurableCopy, WeightsReady
from rlstream.common.errors import DigestMismatchError, WeightReloadError
from rlstream.common.weights.store import stage_version, verify, vouched
from rlstream.producer import telemetry
from rlstream.producer.weights.trainer_link import TrainerLink

log = logging.getLogger("rlstream.producer")

_REJOIN_EVERY_S = 1.0


def digest_refusal(version: int, received: str | None, expected: str | None, whose: str) -> str | None:
    """The one comparison of a received version's digest before it is served, on every
    transport (blake3 on rlstream_gloo, the device fold on nccl: common/weights/digest.py):
    why it is refused, or None. A missing digest refuses: nothing unverified is served."""
    if received is not None and expected is not None and received == expected:
        return None
    return (f"version {version}: received digest {str(received)[:12]} != {whose} {str(expected)[:12]}; "
            "refused, the served weights stay")


class ReloadableEngine(Protocol):
    """What the reloader needs of `producer.engine.RolloutEngine`."""

    version: int
    weight_transfer: str | None

    def reload_weights(self, weights_dir: str | Path, version: int) -> float: ...

    def weight_status(self) -> dict[str, Any]: ...

    def swap_weights(self, version: int, digest: str) -> float: ...

    def discard_weights(self) -> None: ...


def staging_root(store_dir: Path | None, producer_id: str) -> Path:
    """Where durable copies are staged: beside the weight store, on its file system, so staging
    is hard links and no bytes (a 61 GB model, two slots) land on the container's disk;
    a temporary directory where the store is not given or not writable."""
    if store_dir is not None:
        root = store_dir / ".staging" / "".join(c if c.isalnum() or c in "-_." else "_" for c in producer_id)
        try:
            root.mkdir(parents=True, exist_ok=True)
            return root
        except OSError as e:
            log.warning("cannot stage durable copies beside the weight store (%s): staging in %s instead, "
                        "as copies where it is another file system", e, tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="rlstream-weights-"))


class Reloader:
    """Takes announced versions into `engine`, which serves `base_dir` (the model
    directory, version 0) until the first one."""

    def __init__(self, engine: ReloadableEngine, base_dir: str | Path, producer_id: str = "producer",
                 timeout_s: float = 30.0, store_dir: str | Path | None = None):
        self.engine, self.producer_id, self.timeout_s = engine, producer_id, timeout_s
        self.loaded: Path | None = Path(base_dir)
        """The directory of the version the engine serves (None: it came over the link)."""
        self.store_dir = None if store_dir is None else Path(store_dir)
        """The weight store (consumer.weight_store_dir): durable copies are taken from it only."""
        self.stage_root = staging_root(self.store_dir, producer_id)
        self.newest: WeightsReady | None = None
        self.link: TrainerLink | None = None
        self._awaited_since: float | None = None  # the newest announced version is not served since
        self._rejoin_at = 0.0
        self._restoring = False
        self._failure: dict[str, Any] | None = None
        """The last version refused or failed since one was served: /healthz shows it."""
        self._backend_refused: tuple[str, str] | None = None  # (trainer's, ours) once logged

    # ------------------------------------------------------------ the three calls

    def apply(self, msg: WeightsReady) -> bool:
        """A new announcement; True when the engine now serves a newer version."""
        if self.newest is None or msg.version >= self.newest.version:
            self.newest = msg
        if msg.transport == "collective" and self._backend_differs(msg):
            self._failed(msg.version, f"the trainer sends with {msg.backend}, this engine receives with "
                                      f"{self.engine.weight_transfer}: no link; durable copies only")
        elif msg.transport == "collective" and self.engine.weight_transfer is not None:
            if msg.version > self.engine.version and self._awaited_since is None:
                self._awaited_since = time.monotonic()
            return self.tick()
        copy = msg.durable_copy()
        return copy is not None and copy.version > self.engine.version and self._load_durable(copy)

    def tick(self) -> bool:
        """Between two engine steps: run the trainer's commands, serve or refuse a version
        the link received, recover an overdue one. True when the served version changed."""
        if self.newest is None or self.engine.weight_transfer is None or self._backend_differs(self.newest):
            return False
        self._keep_link()
        changed = False
        if self.link is not None:
            self.link.poll()
            if (update := self.link.take_update()) is not None:
                changed = self._take_update(update)
        if self.engine.version >= self.newest.version:
            self._awaited_since = None
        elif self._awaited_since is not None and time.monotonic() - self._awaited_since > self.timeout_s:
            self._awaited_since = time.monotonic()  # try the link again for as long, then again
            why = f"version {self.newest.version} did not arrive over the link within {self.timeout_s:.0f} s"
            self._failed(self.newest.version, why)
            changed = self._fall_back(why) or changed
        return changed

    def catch_up(self, msg: WeightsReady, timeout_s: float | None = None) -> bool:
        """At start, before generating: serve `msg`'s version (over the link, else the durable store)."""
        self.apply(msg)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while self.engine.version < msg.version and time.monotonic() < deadline:
            if msg.transport != "collective" or self.engine.weight_transfer is None or self._backend_differs(msg):
                break
            self.tick()
            time.sleep(0.01)
        if self.engine.version < msg.version:
            self._fall_back(f"version {msg.version} did not arrive over the link at start")
        return self.engine.version >= msg.version

    def state(self) -> dict[str, Any]:
        """The weight state for /healthz and /readyz (read from the HTTP thread: plain reads).

        state: `serving` (nothing pending), `receiving` (a version is arriving or loading),
        `restoring` (a failed load is being undone), `failed` (the last version refused
        or lost, `failure` says why; the served version stays until one arrives)."""
        link = self.link
        update = link.update if link is not None else None
        if self._restoring:
            state = "restoring"
        elif update is not None and not update.settled:
            state = "receiving"
        else:
            state = "failed" if self._failure is not None else "serving"
        newest = self.newest
        return {"state": state, "serving_version": self.engine.version,
                "announced_version": newest.version if newest is not None else None,
                "link": None if link is None else ("dead: " + link.dead if link.dead else
                                                   "linked" if link.channel is not None else "registering"),
                "failure": self._failure,
                "backend_mismatch": None if self._backend_refused is None else
                "trainer sends {}, engine receives {}".format(*self._backend_refused)}

    def _backend_differs(self, msg: WeightsReady) -> bool:
        """The announcement names a backend this engine does not receive with (checked here, once:
        a link across two backends would fail at its first init, every _REJOIN_EVERY_S). A file
        announcement names none."""
        mine = self.engine.weight_transfer
        if msg.backend is None or mine is None or msg.backend == mine:
            self._backend_refused = None  # what /healthz reports is the newest announcement's
            return False
        if self._backend_refused != (msg.backend, mine):
            self._backend_refused = (msg.backend, mine)
            telemetry.TRANSFER_FAILURES.inc()
            log.error("the trainer sends weights with %s but this engine receives with %s "
                      "(producer.engine.weight_transfer): not linking; taking durable copies only",
                      msg.backend, mine)
        return True

    def _failed(self, version, reason: str) -> None:
        self._failure = {"version": version, "reason": reason[:500], "at": time.time()}

    # ------------------------------------------------------------ collective

    def _keep_link(self) -> None:
        """A link to the newest announced endpoint: (re-)register when there is none or it died."""
        endpoint = self.newest.endpoint
        link = self.link
        if link is not None and link.dead:
            telemetry.TRANSFER_FAILURES.inc()
            log.warning("weight link dropped: %s (still serving version %d)", link.dead, self.engine.version)
            self._failed(self.newest.version, f"weight link dropped: {link.dead}")
            self.link = link = None
        # the trainer restarted elsewhere: join at once. A message without an endpoint (transport
        # file) keeps the link: dropping it silently left the trainer's end waiting for acks up
        # to its timeout and cost a new rendezvous at the next collective version.
        if link is not None and endpoint and link.endpoint != endpoint:
            self.link = link = None
            self._rejoin_at = 0.0
        if link is None and endpoint and time.monotonic() >= self._rejoin_at:
            self._rejoin_at = time.monotonic() + _REJOIN_EVERY_S
            self.link = TrainerLink.connect(self.engine, endpoint, self.producer_id, self.timeout_s)

    def _take_update(self, update: TrainerLink.Update) -> bool:
        """A version the link received and the trainer finished: serve it if its digest equals
        the trainer's, else refuse it; the link then answers the trainer with the decision."""
        if update.error is not None and update.staged and self.link.dead:  # a broken pair: nothing touched
            self.engine.discard_weights()
            self._failed(update.version, f"the receive failed: {update.error}")
            return False
        refusal = update.error or digest_refusal(update.version, update.received, update.expected, "sent")
        if refusal is not None:
            self.link.answer_update(update, error=refusal)
            if update.staged:  # the staging is dropped; the served weights were never touched
                self.engine.discard_weights()
                return self._refuse(update.version, refusal)
            telemetry.RELOAD_FAILURES.inc()
            log.error("refusing weight version %d from the link: %s; restoring", update.version, refusal)
            self._restore()  # the nccl load already replaced layers
            self._failed(update.version, refusal)
            self._fall_back("the link's version was refused")
            return True  # the engine's weights were replaced: by the restored ones now
        if update.staged and update.version <= self.engine.version:  # a restarted trainer sends its current
            self.engine.discard_weights()  # version to every new link: held already, nothing to swap
            self.link.answer_update(update)
            return False
        if update.staged:
            return self._swap(update)
        seconds = self.engine.commit_weights(update.version, update.t0)
        self.loaded = None
        self.link.answer_update(update)
        self._served("collective", seconds)
        return True

    def _swap(self, update: TrainerLink.Update) -> bool:
        """gloo: load the staged version into the model between two steps."""
        try:
            seconds = self.engine.swap_weights(update.version, update.received)
        except DigestMismatchError as e:
            self.link.answer_update(update, error=str(e))
            return self._refuse(update.version, str(e))
        except Exception as e:  # noqa: BLE001 - a load that failed halfway is rolled back
            telemetry.RELOAD_FAILURES.inc()
            self.link.answer_update(update, error=f"the swap failed while loading: {e}")
            self._restore()
            self._failed(update.version, f"the swap failed while loading: {e}")
            return False
        self.loaded = None
        self.link.answer_update(update)
        self._served("collective", seconds)
        return True

    def _refuse(self, version, reason: str) -> bool:
        telemetry.RELOAD_FAILURES.inc()
        self._failed(version, reason)
        log.error("refusing weight version %s from the link: %s (still serving version %d)",
                  version, reason, self.engine.version)
        return self._fall_back("the link's version was refused")

    def _fall_back(self, why: str) -> bool:
        """Serve the newest durable copy if it is newer than what is served."""
        copy = self.newest.durable_copy() if self.newest is not None else None
        if copy is None or copy.version <= self.engine.version:
            log.warning("%s; no newer durable copy, still serving version %d", why, self.engine.version)
            return False
        log.warning("%s; taking durable version %d", why, copy.version)
        return self._load_durable(copy)

    # ------------------------------------------------------------ durable

    def _load_durable(self, copy: DurableCopy) -> bool:
        t0 = time.perf_counter()
        staged = self._stage_and_verify(copy)
        if staged is None:
            return False
        try:
            self.engine.reload_weights(staged, copy.version)
        except Exception as e:  # noqa: BLE001 - any load failure is rolled back
            telemetry.RELOAD_FAILURES.inc()
            self._restore()
            self._failed(copy.version, f"loading the durable copy failed: {e}")
            return False
        self.loaded = staged
        self._served("file", time.perf_counter() - t0)
        return True

    def _stage_and_verify(self, copy: DurableCopy) -> Path | None:
        """The staged, verified copy of `copy`'s version, or None (refused, logged, counted)."""
        slot = self.stage_root / ("a" if self.loaded != self.stage_root / "a" else "b")  # not what is loaded
        try:
            if self.store_dir is not None:
                vouched(copy.uri, self.store_dir, copy.version, copy.sha256, copy.bytes)
            staged = stage_version(copy.uri, slot)
            verify(staged.as_uri(), copy.sha256, copy.bytes)
        except Exception as e:  # noqa: BLE001 - a bad version must never take the service down
            telemetry.RELOAD_FAILURES.inc()
            self._failed(copy.version, f"the durable copy did not verify: {e}")
            log.error("refusing weight version %d: %s (still serving version %d)",
                      copy.version, e, self.engine.version)
            return None
        return staged

    def _restore(self) -> None:
        """A load failed halfway, or an nccl update loaded bytes that failed their digest:
        reload what was serving (or the newest durable copy), or raise (never serve half a
        model). The one restore path of every transport."""
        log.error("a weight load failed or was refused after it touched the model; restoring a consistent "
                  "model", exc_info=sys.exc_info()[0] is not None)
        self._restoring = True
        try:
            if self.loaded is not None:
                self.engine.reload_weights(self.loaded, self.engine.version)
                return
            copy = self.newest.durable_copy() if self.newest is not None else None
            staged = self._stage_and_verify(copy) if copy is not None else None
            if staged is None:
                raise WeightReloadError("no durable copy to restore from")
            self.engine.reload_weights(staged, copy.version)
            self.loaded = staged
            telemetry.VERSION.set(self.engine.version)
        except Exception as e:  # noqa: BLE001 - whatever failed, the weights are now inconsistent
            raise WeightReloadError(f"weights are inconsistent after a failed reload and restoring "
                                    f"failed too ({e}); exiting so a supervisor restarts us") from e
        finally:
            self._restoring = False

    def _served(self, transport: str, seconds: float) -> None:
        self._failure = None
        telemetry.RELOAD_SECONDS.observe(seconds)
        telemetry.VERSIONS_TAKEN.labels(transport=transport).inc()
        telemetry.VERSION.set(self.engine.version)

    def close(self) -> None:
        shutil.rmtree(self.stage_root, ignore_errors=True)
