"""Driving a RolloutEngine by hand in tests."""
from __future__ import annotations

import time

import numpy as np

PROMPTS = ("12+34=", "7-3+5=", "90-12=")


def run_until_done(eng, max_steps: int = 1000) -> list:
    """Step the engine until nothing is in flight; every finished sample, in order."""
    out = []
    for _ in range(max_steps):
        if not eng.num_in_flight:
            return out
        out += eng.step()
    raise AssertionError(f"{eng.num_in_flight} samples still in flight after {max_steps} steps")


def greedy(engine, prompts=PROMPTS, max_tokens: int = 6) -> np.ndarray:
    """Greedy log-probs of one sample per prompt, in prompt order (what a weight version computes)."""
    from rlstream.producer.sample import SamplingConfig

    for i, p in enumerate(prompts):
        engine.submit_group(engine.encode(p), n=1, tag=f"greedy-{time.monotonic_ns()}-{i}",
                            sampling=SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    done = []
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda s: s.tag)
    return np.concatenate([s.logprobs for s in done])
