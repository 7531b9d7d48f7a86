"""Who resumes an orphaned episode: pure logic over what the journal topic says.

Liveness is a lease in the journal itself (key `lease:<producer_id>`, value the
process's incarnation and wall time, renewed every lease_s / 4). Why a lease and not
the consumer group membership: the producer is not in a Kafka consumer group (its
clients assign partitions themselves), and the journal is the one topic every
journaling producer already reads and writes, in one partition, so a lease is seen in
order with the entries it covers.

An entry held by (holder, incarnation) is orphaned when
- the holder's newest lease names another incarnation (the producer id restarted:
  its old process is gone; a restarted producer with a fixed id takes its own at once),
- or the holder's lease is older than lease_s (or absent and the entry is).
Each orphan goes to one live producer, the rendezvous-hash winner of the episode key
over the live producers (leases fresher than lease_s): producers that see the same
leases pick the same claimant without talking. Views that differ for a moment can
pick two claimants, and a claimant behind the journal can take a live holder for dead;
the journal itself decides: a claimant writes a claim naming the entry it takes over
(`Held.token`), and every reader applies a claim only if its key still holds that entry
and, by the leases before the claim in the log, that entry is orphaned (`applies`). So
of two claims of one entry only the first takes effect, a claim behind a renewal none,
and each claimant learns which by reading its own claim back (journal.py `take`). A write by a process that no longer holds an entry (a claim
lost, or a holder taken for dead that still runs) is ignored the same way.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    producer_id: str
    incarnation: str
    at: float


@dataclass(frozen=True)
class Held:
    """What the claim logic needs of one journal entry."""

    key: str
    holder: str
    incarnation: str
    written_at: float

    @property
    def token(self) -> str:
        """Names this very entry: what a claim of it carries (`applies`)."""
        return f"{self.holder}/{self.incarnation}/{self.written_at!r}"


def applies(current: Held | None, holder: str, incarnation: str, claimed_from: str, at: float,
            leases: dict[str, Lease], lease_s: float) -> bool:
    """Whether a write to an episode's key takes effect in every reader's view (they fold
    the one partition in the same order, so they all agree). A claim (written at `at`)
    only if it names the entry the key holds now and that entry is orphaned by the leases
    folded before the claim: a claimant whose view of the journal lagged (it missed a
    renewal) loses to the renewal, whatever it saw. Any other write only by that entry's
    holder, or to a new key."""
    if claimed_from:
        return current is not None and current.token == claimed_from and is_orphan(current, leases, at, lease_s)
    return current is None or (current.holder, current.incarnation) == (holder, incarnation)


def is_orphan(entry: Held, leases: dict[str, Lease], now: float, lease_s: float) -> bool:
    lease = leases.get(entry.holder)
    if lease is None:
        return now - entry.written_at > lease_s
    if lease.incarnation != entry.incarnation:
        return True
    return now - lease.at > lease_s


def live_producers(leases: dict[str, Lease], now: float, lease_s: float) -> list[str]:
    return sorted(p for p, lease in leases.items() if now - lease.at <= lease_s)


def claimant(key: str, live: list[str]) -> str | None:
    """The live producer that resumes `key` (highest rendezvous hash), None if none is live."""
    if not live:
        return None
    return max(live, key=lambda p: hashlib.blake2b(f"{key}|{p}".encode(), digest_size=8).digest())


def claims_for(me: str, entries: list[Held], leases: dict[str, Lease], now: float, lease_s: float) -> list[str]:
    """Keys of the orphaned entries `me` resumes (`me` must hold a fresh lease in `leases`)."""
    live = live_producers(leases, now, lease_s)
    return [e.key for e in entries if is_orphan(e, leases, now, lease_s) and claimant(e.key, live) == me]
