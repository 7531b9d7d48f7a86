"""The producer's end of its link to the trainer (common/weights/link.py).

    link = TrainerLink.connect(engine, "10.0.0.5:29600", producer_id, timeout_s)   # GlooLink | NcclLink, by
                                                                                     # the engine's backend
    link.poll()                       # between engine steps: run the trainer's commands, answer them
    update = link.take_update()       # a version received and finished (or failed): the reloader decides
    link.answer_update(update, why)   # served (why=None) or refused: the trainer's finish is answered

The link is the one control channel of a collective version, on both backends: the
trainer offers it (`start`, with its version), streams it, and commits it (`finish`,
with the digest of what it sent); the producer answers the finish only once the
reloader served the version, or with why it refused it. Kafka's WeightsReady only
says where the endpoint is, which version is newest and where its durable copy is.

The trainer drives each transfer through vLLM's four-call handshake
(`VLLMWeightSyncClient`: init, start, update, finish; consumer/weights/client.py
`LinkClient`); `poll` runs each command the trainer posted on the engine, on
the loop's thread, between two steps:

    command   rlstream_gloo (CPU)                       nccl (vLLM's, GPU)
    ping      (nothing: answered, so the trainer knows this producer is alive before a fan-out rendezvous)
    init      close the old group, join the link's      destroy the old communicator, join the
              gloo pair, or the fan-out group's chain   NCCL group (the link's or the fan-out
              at this producer's rank offset            group's, at this producer's rank offset)
              (consumer/weights/fanout.py)
    start     start receiving into staging buffers in   (nothing: the update runs vLLM's three calls)
              the background (the engine keeps stepping)
    update    (nothing: the bytes are already flowing)  receive + load now, folding a digest
                                                        (producer/weights/worker/verified_update.py); then
                                                        wait for the finish (no step runs meanwhile)
    finish    carries the trainer's digest: once the version is received (gloo: its every group
              checked in band) the reloader compares the two, serves the version (gloo: swaps the
              staged buffers in; nccl: commits the loaded layers) or refuses it (gloo: discards
              the staging; nccl: restores), and answers
    close     the trainer dropped the link (a transfer failed): register a new one

Registering connects to the endpoint's store, which blocks when the trainer is
down, so `connect` does it on a thread; `poll` is a no-op until it is done. The
registration reports the engine's receiving workers (`engine.weight_workers`,
vLLM's TP x PP): the trainer sizes the link's group from it (1 + workers, every
worker at rank_offset + its rank), so a TP=2 producer's second worker has a rank.
Any failure marks the link dead (`dead` says why); the reloader drops it and
registers a new one (a failed gloo group is not reusable; an aborted NCCL
communicator is disabled, and updates over it would load empty buffers). Two
exceptions keep the link: a version refused by its digest (the pair is fine), and,
on gloo only, a fan-out group's init that failed (another member never joined the
rendezvous): the trainer re-forms the group without the missing member on this
same link. On nccl a failed init leaves no usable communicator either: the link is
dropped and registered anew.

Once it acknowledged an nccl `start`, the producer waits here (at most `timeout_s`)
for the `update` that follows at once, without stepping its engine: every member of
a group has acknowledged `start` before anyone enters the broadcast, so none can be
late for it (a member busy elsewhere, in a durable load, fails `start` and is left
out, instead of holding the others in their receive until their watchdogs fire).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from rlstream.common.errors import RlstreamError, WeightTransferError
from rlstream.common.weights.backends import GLOO
from rlstream.common.weights.link import Channel, open_store, parse_endpoint, register

log = logging.getLogger("rlstream.producer")


class TrainerLink(ABC):
    """The base of the two receivers, `GlooLink` and `NcclLink`, one chosen per engine by
    `TrainerLink.connect` (or constructed directly): registration, the command loop, the
    version handed to the reloader and its answer. A subclass says what `start` and `update`
    do and how a version in flight settles."""

    staged: bool = False
    """Versions arrive in the background into staging buffers (gloo), or are loaded into the
    model by the update command itself (nccl)."""

    @dataclass
    class Update:
        """One version the trainer sent over this link, from its start to the reloader's decision."""

        version: int
        t0: float
        staged: bool
        """rlstream_gloo: received into staging buffers apart from the model (served by a swap,
        refused by discarding them); nccl: loaded into the model's layers (served by a commit,
        refused by restoring what was served)."""
        received: str | None = None
        """The digest of what arrived (gloo: the version digest of the groups checked in band;
        nccl: the device fold), None until it is all here or when it failed (`error`)."""
        expected: str | None = None
        """The trainer's digest of what it sent, from its finish."""
        error: str | None = None
        finish: int | None = None
        """The trainer's finish command, answered once the reloader decided (`answer_update`)."""
        received_at: float | None = None

        @property
        def settled(self) -> bool:
            """Ready for the reloader: failed, or received and finished."""
            return self.error is not None or (self.received is not None and self.finish is not None)

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
        self.update: TrainerLink.Update | None = None
        """The version in flight, until the reloader takes it (right after `poll`)."""

    @classmethod
    def connect(cls, engine, endpoint: str, producer_id: str, timeout_s: float) -> "TrainerLink":
        """A link of the engine's backend (`cls` itself when called on a subclass), registering
        on a thread of its own."""
        if cls is TrainerLink:
            cls = GlooLink if engine.weight_transfer == GLOO else NcclLink
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
            if self.update is not None and not self.update.settled:
                self._settle(self.update)
        except (RlstreamError, RuntimeError, OSError) as e:  # the store or the pair broke
            self.dead = f"link {self.channel.link}: {e}"
            u = self.update
            if u is not None and u.error is None and u.finish is None:
                u.error = self.dead  # never verified: the reloader discards or restores it
            elif u is not None and u.error is not None and u.finish is not None:
                self._ack_quietly(u.finish, error=u.error[:2000])  # the trainer learns now, not at its timeout

    def take_update(self) -> "TrainerLink.Update | None":
        """The version to serve or refuse, once it is settled (received and finished, or failed)."""
        u = self.update
        if u is None or not u.settled:
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
            elif op == "start":
                self._start(cmd)
            elif op == "update":
                self._update(cmd)
            elif op == "finish":
                if self.update is None or self.update.version != cmd.get("version"):
                    raise WeightTransferError(f"finish of version {cmd.get('version')} without its "
                                              f"{'start' if self.staged else 'update'}")
                self.update.expected, self.update.finish = cmd.get("digest"), k
                return  # answered by the reloader once it decided (answer_update)
            else:
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
        self._after(op)

    def _ack_quietly(self, k: int, **result) -> None:
        with contextlib.suppress(RlstreamError, RuntimeError, OSError):  # the channel may be what broke
            self.channel.ack(k, **result)

    # ------------------------------------------------------------------ what the backends do

    @abstractmethod
    def _start(self, cmd: dict[str, Any]) -> None: ...

    @abstractmethod
    def _update(self, cmd: dict[str, Any]) -> None: ...

    def _after(self, op: str) -> None:
        """After a command was run and acknowledged."""

    @abstractmethod
    def _settle(self, u: "TrainerLink.Update") -> None:
        """A version in flight that is not settled yet, after the commands of a poll."""


class GlooLink(TrainerLink):
    """rlstream_gloo: `start` receives into staging buffers in the background while the engine
    keeps stepping (every group checked in band); the version settles once it is all here and
    the trainer's finish arrived."""

    staged = True

    def _start(self, cmd: dict[str, Any]) -> None:
        self.update = None
        self.engine.receive_weights()
        self.update = TrainerLink.Update(int(cmd["version"]), time.perf_counter(), staged=True)

    def _update(self, cmd: dict[str, Any]) -> None:
        pass  # the bytes are already flowing

    def _settle(self, u: "TrainerLink.Update") -> None:
        """The background receive of `u` (a status call to every worker), until it arrived;
        then its finish, at most `timeout_s` later."""
        if u.received is None:
            st = self.engine.weight_status()
            if st["state"] == "receiving":
                return
            if st["state"] == "ready" and st["version"] == u.version:
                u.received, u.received_at = st["digest"], time.monotonic()
            elif st["state"] == "failed" and st.get("digest_mismatch"):
                u.error = st["error"]  # a group failed its digest in band: refused, the pair is fine
                return
            else:  # a broken pair, or the stream carried another version: this link is done
                u.error = st.get("error") or (f"received version {st.get('version')}, the trainer started "
                                              f"{u.version}" if st["state"] == "ready" else
                                              f"nothing received ({st['state']})")
                raise WeightTransferError(u.error)
        if u.finish is None and time.monotonic() - u.received_at > self.timeout_s:
            u.error = f"no finish from the trainer within {self.timeout_s:.0f} s of receiving version {u.version}"
            raise WeightTransferError(u.error)


class NcclLink(TrainerLink):
    """vLLM's nccl: the `update` that follows an acknowledged `start` at once receives and loads
    the version into the model, folding a digest; no engine step runs until its finish."""

    staged = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started = False  # a start acknowledged: its update comes next

    def _start(self, cmd: dict[str, Any]) -> None:
        self._started = True

    def _update(self, cmd: dict[str, Any]) -> None:
        self.update = TrainerLink.Update(int(cmd["version"]), time.perf_counter(), staged=False)
        self.update.received = self.engine.load_weight_update(cmd["update_info"], self.timeout_s)

    def _after(self, op: str) -> None:
        """`start` acknowledged: run the `update` the trainer posts next (within `timeout_s`)."""
        if op != "start" or not self._started:
            return
        self._started = False
        deadline = time.monotonic() + self.timeout_s
        while (cmd := self.channel.next_command()) is None:
            if time.monotonic() > deadline:
                raise WeightTransferError(f"no update from the trainer within {self.timeout_s:.0f} s of its start")
            time.sleep(0.001)
        self._run(*cmd)

    def _settle(self, u: "TrainerLink.Update") -> None:
        """The update is loaded but unverified: no engine step may run on it, so wait here (at
        most `timeout_s`) for the trainer's finish, which carries its digest. The trainer posts
        it as soon as its broadcast ends, which is when the update returned."""
        deadline = time.monotonic() + self.timeout_s
        while u.finish is None and u.error is None:
            cmd = self.channel.next_command()
            if cmd is not None:
                self._run(*cmd)
            elif time.monotonic() > deadline:
                u.error = f"no finish from the trainer within {self.timeout_s:.0f} s of the update"
                raise WeightTransferError(u.error)
            else:
                time.sleep(0.001)
