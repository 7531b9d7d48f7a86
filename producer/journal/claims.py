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

Epochs (fencing tokens). An episode's first entry has epoch 0; a claim that applies holds
the entry at the epoch after the one it takes over, and its holder's later writes carry
that epoch (any other epoch is ignored). Every record the episode publishes carries it
(common/record/ `claim_epoch`): the consumer trains an episode only from its newest
claim, so a holder cut off past its lease (alive, still publishing) is fenced there too.

Time. Every time these rules compare is the reader's judgement of a journal time
(`trusted`): at most `skew_s` ahead of the reader's own clock. A claim or a lease dated
further ahead counts as dated now + skew, so it can neither make a live holder look dead
(the claim would need lease_s of lead) nor keep a dead producer alive past lease_s + skew.
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
    epoch: int = 0
    at: float | None = None
    """`written_at` as this reader trusts it (`trusted`); None: as written."""
    claimed_from: str = ""
    """On a claim: the token of the entry it takes over; else empty."""
    resumed_from: str = ""
    """The token of the entry this epoch's claim took over (empty at epoch 0)."""

    @property
    def token(self) -> str:
        """Names this very entry: what a claim of it carries (`applies`)."""
        return f"{self.holder}/{self.incarnation}/{self.written_at!r}"

    @property
    def when(self) -> float:
        return self.written_at if self.at is None else self.at


def token_time(token: str) -> float | None:
    """The write time a claim's `claimed_from` token names (None if it names none)."""
    try:
        return float(token.rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return None


def skew_bound(lease_s: float, max_skew_s: float) -> float:
    """The skew a reader grants a journal time: `max_clock_skew_s`, at most lease_s / 4 (a
    claim dated skew ahead must stay short of making a lease renewed lease_s / 4 ago lapse)."""
    return max(0.0, min(max_skew_s, lease_s / 4))


def trusted(t: float, now: float, skew_s: float) -> float:
    """A journal time as a reader whose clock reads `now` trusts it."""
    return min(t, now + skew_s)


def applies(current: Held | None, new: Held, leases: dict[str, Lease], lease_s: float) -> bool:
    """Whether a write to an episode's key takes effect in every reader's view (they fold
    the one partition in the same order, so they agree wherever their clocks do). A claim
    (`new.claimed_from` set, judged at `new.when`) only if it names the entry the key holds
    now, at the next epoch, and that entry is orphaned by the leases folded before the
    claim: a claimant whose view of the journal lagged (it missed a renewal) loses to the
    renewal, whatever it saw. Any other write only by that entry's holder at its epoch, or
    to a new key."""
    if new.claimed_from:
        return (current is not None and current.token == new.claimed_from and new.epoch == current.epoch + 1
                and is_orphan(current, leases, new.when, lease_s))
    if current is None:
        return True
    return (current.holder, current.incarnation, current.epoch) == (new.holder, new.incarnation, new.epoch)


def is_orphan(entry: Held, leases: dict[str, Lease], now: float, lease_s: float) -> bool:
    lease = leases.get(entry.holder)
    if lease is None:
        return now - entry.when > lease_s
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
