"""The producer's end of its link to the trainer (common/weights/link.py).

    link = TrainerLink.connect(engine, "10.0.0.5:29600", producer_id, timeout_s)   # a thread registers
    link.poll()          # between engine steps: run the trainer's commands, answer them

The trainer drives each transfer through vLLM's four-call handshake
(`VLLMWeightSyncClient`: init, start, update, finish; consumer/weights/engines.py
`LinkClient`); `poll` runs each command the trainer posted on the engine, on
the loop's thread, between two steps, and acknowledges it:

    command   rlstream_gloo (CPU)                       nccl (vLLM's, GPU)
    ping      (nothing: answered, so the trainer knows this producer is alive before a fan-out rendezvous)
    init      close the old group, join the link's      destroy the old communicator, join the
              gloo pair, or the fan-out group's chain   NCCL group (the link's or the fan-out
              at this producer's rank offset            group's, at this producer's rank offset)
              (consumer/weights/fanout.py)
    start     start receiving in the background         (nothing: the update runs vLLM's three calls)
    update    (nothing: the bytes are already flowing)  receive + load now, folding a digest
                                                        (producer/weights/verified_update.py); then
                                                        wait for the finish (no step runs meanwhile)
    finish    answered once the version is received     carries the trainer's digest: the reloader
              and verified (the reloader swaps it in    compares, serves or restores, then answers
              when the announcement's digest matches)
    close     the trainer dropped the link (a transfer failed): register a new one

Registering connects to the endpoint's store, which blocks when the trainer is
down, so `connect` does it on a thread; `poll` is a no-op until it is done. The
registration reports the engine's receiving workers (`engine.weight_workers`,
vLLM's TP x PP): the trainer sizes the link's group from it (1 + workers, every
worker at rank_offset + its rank), so a TP=2 producer's second worker has a rank.
Any failure marks the link dead (`dead` says why); the reloader drops it and
registers a new one (a failed gloo group is not reusable; an aborted NCCL
communicator is disabled, and updates over it would load empty buffers). One
exception, on gloo only: a fan-out group's init that failed (another member never
joined the rendezvous) is refused and the link kept, and the trainer re-forms the
group without the missing member on this same link. On nccl a failed init leaves
no usable communicator either: the link is dropped and registered anew.

Once it acknowledged an nccl `start`, the producer waits here (at most `timeout_s`)
for the `update` that follows at once, without stepping its engine: every member of
a group has acknowledged `start` before anyone enters the broadcast, so none can be
late for it (a member busy elsewhere, in a durable load, fails `start` and is left
out, instead of holding the others in their receive until their watchdogs fire).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from common.errors import RlstreamError, WeightTransferError
from common.weights.backends import GLOO
from common.weights.link import Channel, open_store, parse_endpoint, register

log = logging.getLogger("rlstream.producer")


class TrainerLink:
    @dataclass
    class Update:
        """An nccl update loaded into the engine but not served yet: the reloader compares
        `received` with `expected` (the trainer's, from its finish) and serves or restores."""

        version: int
        t0: float
        received: str | None = None
        """The digest the workers folded while loading (None: the load failed, see `error`)."""
        expected: str | None = None
        error: str | None = None
        finish: int | None = None
        """The trainer's finish command, answered once the reloader decided."""

    def __init__(self, engine, endpoint: str, producer_id: str, timeout_s: float):
        self.engine, self.endpoint, self.timeout_s = engine, endpoint, timeout_s
        self.producer_id = producer_id
        self.workers = int(engine.weight_workers)
        """Workers that join the link's group (read here: `connect` runs on the engine's thread)."""
        self.channel: Channel | None = None
        self.dead: str | None = None
        """Why the link is unusable (None while it is fine)."""
        self.joined = False
        """The init command ran: the gloo pair (or NCCL group) is up."""
        self._finish: int | None = None  # a finish command waiting for the receive to end
        self._finish_version: int | None = None
        self.swapped: tuple[int, str] | None = None
        """(version, digest) the reloader last swapped in from this link: a finish that
        arrives (or is answered) after the swap acknowledges it."""
        self._started = False  # a background receive started since the reloader last asked
        self._started_nccl = False  # an nccl start acknowledged: its update comes next
        self.update: TrainerLink.Update | None = None
        """An nccl update loaded and not yet verified (the reloader takes it right after `poll`)."""

    @classmethod
    def connect(cls, engine, endpoint: str, producer_id: str, timeout_s: float) -> "TrainerLink":
        link = cls(engine, endpoint, producer_id, timeout_s)
        threading.Thread(target=link._register, name="rlstream-weights-join", daemon=True).start()
        return link

    def _register(self) -> None:
        try:
            host, port = parse_endpoint(self.endpoint)
            store = open_store(host, port, min(self.timeout_s, 10.0))
            self.channel = Channel(store, register(store, self.producer_id, self.workers))
            log.info("registered link %d (%d workers) at the trainer's weight endpoint %s", self.channel.link,
                     self.workers, self.endpoint)
        except (RlstreamError, RuntimeError, OSError) as e:
            self.dead = f"cannot register at {self.endpoint}: {e}"

    # ------------------------------------------------------------------ commands

    def poll(self) -> None:
        """Run the trainer's pending commands (between engine steps); mark the link dead on failure."""
        if self.channel is None or self.dead:
            return
        try:
            while (cmd := self.channel.next_command()) is not None:
                self._run(*cmd)
                if self._started_nccl:
                    self._await_update()
            if self._finish is not None:
                self._answer_finish()
            if self.update is not None and self.update.received and self.update.finish is None:
                self._await_nccl_finish()
        except (RlstreamError, RuntimeError, OSError) as e:  # the store or the pair broke
            self.dead = f"link {self.channel.link}: {e}"
            if self.update is not None and self.update.error is None and self.update.finish is None:
                self.update.error = self.dead  # loaded, never verified: the reloader restores

    def _await_update(self) -> None:
        """nccl: `start` acknowledged; run the `update` the trainer posts next (within `timeout_s`)."""
        self._started_nccl = False
        deadline = time.monotonic() + self.timeout_s
        while (cmd := self.channel.next_command()) is None:
            if time.monotonic() > deadline:
                raise WeightTransferError(f"no update from the trainer within {self.timeout_s:.0f} s of its start")
            time.sleep(0.001)
        self._run(*cmd)

    def _await_nccl_finish(self) -> None:
        """An nccl update is loaded but unverified: no engine step may run on it, so wait here
        (at most `timeout_s`) for the trainer's finish, which carries its digest. The trainer
        posts it as soon as its broadcast ends, which is when the update returned."""
        deadline = time.monotonic() + self.timeout_s
        while self.update.finish is None:
            cmd = self.channel.next_command()
            if cmd is not None:
                self._run(*cmd)
            elif time.monotonic() > deadline:
                self.update.error = f"no finish from the trainer within {self.timeout_s:.0f} s of the update"
                raise WeightTransferError(self.update.error)
            else:
                time.sleep(0.001)

    def take_update(self) -> "TrainerLink.Update | None":
        """The nccl update to verify or restore, once it is settled (finished or failed)."""
        u = self.update
        if u is None or (u.error is None and u.finish is None):
            return None
        self.update = None
        return u

    def answer_update(self, update: "TrainerLink.Update", error: str | None = None) -> None:
        """Answer the trainer's finish with the reloader's decision (served, or refused)."""
        if update.finish is None or self.channel is None or self.dead:
            return
        try:
            if error is None:
                self.channel.ack(update.finish, version=update.version, digest=update.received)
            else:
                self.channel.ack(update.finish, error=error[:2000])
        except (RlstreamError, RuntimeError, OSError) as e:
            self.dead = f"link {self.channel.link}: {e}"

    def _run(self, k: int, cmd: dict[str, Any]) -> None:
        op = cmd.get("op")
        if op == "close":  # the trainer dropped this link (a failed transfer): register anew
            raise WeightTransferError(f"closed by the trainer: {cmd.get('reason', '')}")
        try:
            if op == "ping":  # the trainer checks who is alive before it forms a fan-out group
                pass
            elif op == "init":
                self.joined = False
                self.engine.init_weight_link(cmd["init_info"])
                self.joined = True
            elif op == "start" and self.engine.weight_transfer == GLOO:
                self.engine.receive_weights()
                self._started = True
            elif op == "start" and self.engine.weight_transfer == "nccl":
                self._started_nccl = True
            elif op == "update" and self.engine.weight_transfer == "nccl":
                self.update = TrainerLink.Update(int(cmd["version"]), time.perf_counter())
                self.update.received = self.engine.load_weight_update(cmd["update_info"], self.timeout_s)
            elif op == "finish" and self.engine.weight_transfer == "nccl":
                if self.update is None or self.update.version != cmd.get("version"):
                    raise WeightTransferError(f"finish of version {cmd.get('version')} without its update")
                self.update.expected, self.update.finish = cmd.get("digest"), k
                return  # answered by the reloader once it compared the digests (answer_update)
            elif op == "finish" and self.engine.weight_transfer == GLOO:
                self._finish, self._finish_version = k, cmd.get("version")  # answered once received
                return self._answer_finish()
            elif op not in ("start", "update", "finish"):
                raise WeightTransferError(f"unknown command {op!r} from the trainer")
        # vLLM's multiprocess engine (any TP > 1) reports a worker's error as a bare Exception
        except Exception as e:  # noqa: BLE001 - refused, acknowledged; the loop keeps serving
            if op == "update" and self.update is not None:
                self.update.error = f"the update failed while loading: {e}"  # half-loaded: restore
            self.channel.ack(k, error=str(e)[:2000])
            if op == "init" and not cmd["init_info"].get("group"):  # a gloo fan-out group that did not form
                # is re-formed without its missing member on this link; anything else: the link is done
                raise e if isinstance(e, RlstreamError) else WeightTransferError(f"joining the link failed: {e}") from e
            if op == "update":  # nccl: an aborted or broken communicator is disabled; the link is done
                raise WeightTransferError(f"the update failed: {e}") from e
            return
        self.channel.ack(k)

    def take_started(self) -> bool:
        """A background receive started since the last call (the reloader then watches the
        engine's status until that version is swapped in or dropped)."""
        started, self._started = self._started, False
        return started

    def _answer_finish(self) -> None:
        st = self.engine.weight_status()
        if st["state"] == "receiving":
            return
        k, self._finish = self._finish, None
        if st["state"] == "ready":
            self.channel.ack(k, version=st["version"], digest=st["digest"])
        elif st["state"] == "idle" and self.swapped is not None and self.swapped[0] == self._finish_version:
            # the receive ended and the reloader swapped it in (its announcement was already
            # here) before this finish was answered: the version arrived and verified
            self.channel.ack(k, version=self.swapped[0], digest=self.swapped[1])
        else:
            self.channel.ack(k, error=st.get("error") or f"nothing received ({st['state']})")
            if not st.get("digest_mismatch"):  # a broken pair: this link is done
                raise WeightTransferError(st.get("error") or "the receive failed")
