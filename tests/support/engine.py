"""Driving a RolloutEngine by hand in tests."""
from __future__ import annotations


def run_until_done(eng, max_steps: int = 1000) -> list:
    """Step the engine until nothing is in flight; every finished sample, in order."""
    out = []
    for _ in range(max_steps):
        if not eng.num_in_flight:
            return out
        out += eng.step()
    raise AssertionError(f"{eng.num_in_flight} samples still in flight after {max_steps} steps")
