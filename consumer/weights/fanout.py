"""The fan-out group: every registered producer's workers in one group, each version sent once.

    fan = Fanout(sender)          # one thread; WeightSender starts it
    # per version: re-form if the members changed, then start -> stream -> finish

A producer's first version goes over its own link (consumer/weights/sender.py `_Link`):
a joiner gets the current version at once, without waiting for, or stalling, the
group. Once it holds the newest version its link hands it over here, and it enters
the group at the next version boundary. The group is the trainer (rank 0) plus every
member's workers, ranks from `group_layout` over the members' worker counts (the
same sizing and rank offsets as vLLM's nccl engine). It is re-formed (a new epoch,
a new PrefixStore prefix) whenever the members of the next round differ from the
formed group: a producer joined, left or failed.

The bytes: on CPU (`rlstream_gloo`) a chunk-pipelined chain (common/weights/chain.py:
gloo has no pipelined broadcast); on GPU vLLM's own `nccl` trainer engine over the whole
group (NCCL pipelines its broadcast), with one upload of the snapshot to the trainer's
GPU per version instead of one per producer. Both run through `FanoutClient`, vLLM's
`VLLMWeightSyncClient` fanned out to every member's command channel, so the trainer
engines are the same classes a single link uses.

Failures (each blocking call bounded by `consumer.weights.timeout_s`; on nccl the trainer's
send also runs under a watchdog that aborts it once NCCL reports a lost peer, nccl.py `NcclTrainer.send`):
- before the stream (ping, init, start): members that did not answer are dropped and
  the round is re-formed with the rest and re-sent at once (nobody received anything);
- during the stream: a dead member fails the ranks after it in the chain (the ranks
  before it keep receiving), the finish round names who did not get the version;
  those are dropped (told to re-register) and the others keep their version. A
  dropped producer that is alive re-registers (producer/weights/reload.py) and gets
  the version over a link of its own, then re-enters the group: the others lose at
  most the one timeout of the finish round, never a re-send;
- nccl: each member commits as soon as it holds the whole version (its finish follows
  its own update: `FanoutClient.commit_early`), so a member that dies, or that a dead
  one cuts off in NCCL's ring, costs those that received nothing; those after it fail
  their receive once NCCL reports the lost peer, register anew and take the version
  over their own links; the trainer's send ends at its watchdog.

A producer that registers anew supersedes its older links (sender.py `_supersede`): the
next round re-forms without them instead of waiting for their commands to time out.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from rlstream.common.errors import RlstreamError, WeightTransferError
from rlstream.common.weights import link as wlink
from rlstream.common.weights.chain import group_prefix
from rlstream.consumer import telemetry

log = logging.getLogger("rlstream.consumer")


class Member(Protocol):
    """What the group needs of one producer's link (consumer/weights/sender.py `_Link`)."""

    n: int
    name: str
    producer: str
    client: Any
    engine: Any
    workers: int

    def release_own(self) -> None: ...


class Rounds(Protocol):
    """What the group's thread needs of the sender (consumer/weights/sender.py `WeightSender`)."""

    def next_round(self) -> tuple[Any, list[Member]] | None:
        """The newest version and the grouped members behind on it; None once closed."""

    def delivered(self, members: list[Member], version: int) -> None: ...

    def drop(self, member: Member, error: BaseException) -> None: ...


class FanoutFailure(WeightTransferError):
    """Some members failed one call of a round: `failed` maps link id -> why."""

    def __init__(self, op: str, failed: dict[int, str], silent: set[int] = frozenset()):
        self.op, self.failed, self.silent = op, failed, set(silent)
        """`silent`: the failed members that did not answer at all (dead or hung)."""
        super().__init__(f"fan-out {op!r} failed on links {sorted(failed)}: "
                         + "; ".join(f"{n}: {why[:200]}" for n, why in sorted(failed.items())))


class FanoutClient:
    """vLLM's `VLLMWeightSyncClient` over every member's channel at once: each call runs
    on every member concurrently (so a dead one costs one timeout, not one per member);
    the init payload gets each member's own rank offset (vLLM's trainer engines hand
    every worker `rank_offset=1`: right for one producer, not for a group)."""

    def __init__(self, members: list["Member"], layout: wlink.GroupLayout, commit_early: bool = False):
        self.members, self.layout = members, layout
        self.version: int | None = None
        self.fold = None
        """The sent version's digest getter, carried by every finish (client.py `LinkClient.fold`)."""
        self.commit_early = commit_early
        """nccl: each member gets its finish as soon as its update returned (it holds the whole version,
        so the trainer had iterated every tensor: the fold is complete), not once every member has:
        a member that received commits, whatever happens to the others (`committed`)."""
        self.committed: dict[int, dict] = {}
        """Members whose finish was acknowledged this round (their acks)."""
        self.settled = threading.Event()
        """The round's update calls have all returned or failed."""

    def new_round(self) -> None:
        self.committed = {}
        self.settled.clear()

    def _each(self, op: str, call: Callable[[int, "Member"], Any]) -> dict[int, Any]:
        results, failed, silent = {}, {}, set()
        with ThreadPoolExecutor(max_workers=len(self.members), thread_name_prefix="rlstream-fanout") as exe:
            futures = {m.n: exe.submit(call, i, m) for i, m in enumerate(self.members)}
            for n, f in futures.items():
                try:
                    results[n] = f.result()
                except (RlstreamError, RuntimeError, OSError) as e:
                    failed[n] = str(e)
                    if isinstance(e, wlink.NoAnswerError):
                        silent.add(n)
        if failed:
            raise FanoutFailure(op, failed, silent)
        return results

    def _versioned(self, m: "Member"):
        m.client.version, m.client.fold = self.version, self.fold
        return m.client

    def ping(self) -> None:
        """Every member answers a command (a dead or hung one does not, within the timeout):
        run before a rendezvous, which a missing member would fail for everyone."""
        self._each("ping", lambda i, m: m.client.channel.call("ping", m.client.timeout_s))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """The trainer engine's worker payload, with each member's own rank offset (and, for the
        gloo twin, whose payload names a link, its link id). Nothing else is added: vLLM's worker
        parses the payload into its init-info dataclass, which refuses unknown keys."""
        offsets = self.layout.rank_offsets

        def payload(i: int, m: "Member") -> dict[str, Any]:
            own = {"rank_offset": offsets[i]}
            if "link" in init_info:
                own["link"] = m.n
            return {**init_info, **own}

        self._each("init", lambda i, m: m.client.init_weight_transfer_engine(payload(i, m)))

    def start_weight_update(self) -> None:
        self._each("start", lambda i, m: self._versioned(m).start_weight_update())

    def update_weights(self, update_info) -> None:
        def update(i: int, m: "Member") -> None:
            self._versioned(m).update_weights(update_info)
            if self.commit_early:
                self.committed[m.n] = self._versioned(m).finish_weight_update()
        try:
            self._each("update", update)
        finally:
            self.settled.set()

    def finish_weight_update(self, weight_version: str | None = None) -> dict:
        """Every member's finish, carrying the sent digest: each serves the version only if it
        received the same, else refuses it; raises FanoutFailure naming those that refused (or
        acknowledged other bytes). Returns {"digest": the sent one}. Committed early (nccl):
        every member's finish came with its update."""
        sent = self.fold() if self.fold is not None else None
        if self.commit_early:
            return {"digest": sent}
        acks = self._each("finish", lambda i, m: self._versioned(m).finish_weight_update(weight_version))
        odd = {n: f"acknowledged digest {str(a.get('digest'))[:12]}, sent {str(sent)[:12]}"
               for n, a in acks.items() if a.get("digest") != sent}
        if odd:
            raise FanoutFailure("finish", odd)
        return {"digest": sent}


class Fanout(threading.Thread):
    """The group's thread: one round per version for every grouped member behind on it."""

    def __init__(self, sender: "Rounds"):
        super().__init__(name="rlstream-weights-fanout", daemon=True)
        self.sender = sender
        self.epoch = 0
        self.formed: tuple[int, ...] = ()
        """Link ids of the formed group, in rank order."""
        self.engine = None
        self.last: dict[str, float] = {}

    def run(self) -> None:
        try:
            while (step := self.sender.next_round()) is not None:
                snap, members = step
                try:
                    self._round(snap, members)
                finally:
                    snap.release()
        finally:
            self._disband()

    def _round(self, snap, members: list["Member"]) -> None:
        t0 = time.perf_counter()
        try:
            if self.engine is None or tuple(m.n for m in members) != self.formed:
                self._reform(snap, members)
            self.engine.client.new_round()
            self._send(snap)
        except FanoutFailure as f:
            early = self.engine is not None and self.engine.client.commit_early
            committed = self._disband_after_failure()
            if f.op in ("ping", "init", "start"):  # nobody received. A silent member fails the rendezvous for
                lost = f.silent or set(f.failed)  # everyone: drop it, re-form with those that answered (they live)
            elif early:  # nccl: the members that committed have the version; the rest do not
                lost = {m.n for m in members} - committed
            else:  # gloo: the stream went out; whoever did not confirm it is dropped
                lost = set(f.failed)
            self._settle(snap, members, lost, {n: WeightTransferError(why) for n, why in f.failed.items()},
                         WeightTransferError(f"the group's {f.op} failed"))
            return
        except (RlstreamError, RuntimeError, OSError) as e:  # the stream broke at rank 0 (nccl: aborted)
            committed = self._disband_after_failure()
            if committed:
                log.warning("weight fan-out: the send of version %d failed (%s); %d of %d members had it",
                            snap.version, e, len(committed), len(members))
            self._settle(snap, members, {m.n for m in members} - committed, {}, e)
            return
        self.sender.delivered(members, snap.version)
        self.last = {"seconds": time.perf_counter() - t0, "members": len(members)}
        telemetry.WEIGHT_SEND_SECONDS.observe(self.last["seconds"])

    def _settle(self, snap, members: list["Member"], lost: set[int], why: dict[int, BaseException],
                default: BaseException) -> None:
        """Members in `lost` are dropped (their links broken: the producers re-register), the others
        hold `snap`'s version."""
        for m in members:
            if m.n in lost:
                self.sender.drop(m, why.get(m.n, default))
        self.sender.delivered([m for m in members if m.n not in lost], snap.version)

    def _disband_after_failure(self) -> set[int]:
        """Disband after a failed round; the members that committed the version (nccl) once the
        round's update calls have settled (within their timeout: a dead member's never answers)."""
        client = self.engine.client if self.engine is not None else None
        self._disband()
        if client is None or not client.commit_early:
            return set()
        client.settled.wait(self.sender.settings.timeout_s * 2)
        return set(client.committed)

    def _reform(self, snap, members: list["Member"]) -> None:
        """A new epoch of the group for `members` (ranks in their order, `group_layout`)."""
        self._disband()
        layout = wlink.group_layout([m.workers for m in members])
        transport, sender = self.sender.transport, self.sender
        client = FanoutClient(members, layout, commit_early=transport.commit_early)
        client.ping()
        self.epoch += 1
        self.engine = transport.open(client, sender.host, sender.store.port, snap, layout, sender.settings.timeout_s,
                                     group=group_prefix(self.epoch))
        self.formed = tuple(m.n for m in members)
        for m in members:
            m.release_own()  # a joiner's own group, kept until now (the producer re-inits anyway)
            m.name, m.engine = self.name, self.engine
        log.info("weight fan-out epoch %d: %d producers, %d ranks (%s)", self.epoch, len(members),
                 layout.world_size, ", ".join(f"{m.producer}@{o}" for m, o in zip(members, layout.rank_offsets)))

    def _send(self, snap) -> None:
        self.sender.transport.send(self.engine, snap, self.sender.settings.timeout_s)

    def _disband(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.formed = None, ()


__all__ = ["Fanout", "FanoutClient", "FanoutFailure"]
