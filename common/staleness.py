"""The staleness rule both roles apply, in one place.

A sample's staleness is the trainer's version minus the oldest policy version
any of its model tokens was sampled with (`Rollout.oldest_version`); a
sample newer than the trainer (after a restore from an older checkpoint)
counts 0. It is stale when its staleness exceeds `max_staleness`.

The consumer's gate (consumer/stream/gate.py) drops a group with a stale sample
(after a crash it measures both ends in optimizer steps of the lineage,
`GateClock`, with this same rule); the producer (producer/eviction.py) aborts
in-flight groups the gate would drop, since the trainer's version only grows.
"""
from __future__ import annotations


def staleness_of(trainer_version: int, oldest_version: int) -> int:
    """How far a sample's oldest model token is behind the trainer, >= 0 (in versions; the
    consumer passes optimizer steps of the lineage after a crash)."""
    return max(0, trainer_version - oldest_version)


def is_stale(staleness: int, max_staleness: int) -> bool:
    """A sample (or a group, by its stalest sample) is beyond the bound."""
    return staleness > max_staleness
