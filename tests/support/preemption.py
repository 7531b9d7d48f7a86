"""Routing under preemption: tests/integration/preemption_worker.py in its own process
(an engine whose KV cache cannot hold its requests at once, then each prompt alone), and
the check every routing capture must pass on its samples (test_routing_preemption.py; the
GPU's native routed-experts output in tests/gpu/test_producer_gpu.py).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.support.hf_reference import hf_sampled_logprobs, load_hf_model

REPO = Path(__file__).resolve().parents[2]


def run_preemption_worker(model_dir: Path, tmp: Path, routing: str) -> dict:
    """preemption_worker.py's two runs (together: preempted; alone: not)."""
    out = tmp / f"samples-{routing}.pkl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "tests.integration.preemption_worker", str(model_dir), str(out), routing]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def check_preempted_routing(runs: dict, model_dir: Path, replay_tol: float, same_as_alone: bool) -> str:
    """Every sample's rows cover P + T - 1 positions, the preempted ones replay in HF to
    vLLM's log-probs within `replay_tol`, and (`same_as_alone`) every sample equals its
    run alone. Returns a one-line summary."""
    together = sorted(runs["together"], key=lambda s: s.tag)
    preempted = {rid: at for rid, at in runs["preempted_at"].items() if at}
    # the premise: vLLM did preempt requests that had generated tokens, and none when alone
    assert any(n > 0 for at in preempted.values() for n in at), runs["preempted_at"]
    assert runs["preemptions_alone"] == 0
    model = load_hf_model(model_dir)
    L, K = model.config.num_hidden_layers, model.config.num_experts_per_tok
    worst, equal = 0.0, 0
    for s, ref in zip(together, runs["alone"]):
        P, T = s.prompt_ids.size, s.response_ids.size
        assert s.routed_experts is not None and s.routed_experts.shape == (P + T - 1, L, K), s.request_id
        equal += int(np.array_equal(s.response_ids, ref.response_ids)
                     and np.array_equal(s.routed_experts, ref.routed_experts))
        if s.request_id in preempted:
            hf = hf_sampled_logprobs(model, s, routing=s.routed_experts)
            worst = max(worst, float(np.abs(hf - s.logprobs).max()))
    summary = (f"{len(preempted)} of {len(together)} requests preempted (tokens generated at preemption: "
               f"{sorted(n for at in preempted.values() for n in at)}); {equal} equal to their runs alone; "
               f"HF replay max |diff| = {worst:.3g}")
    assert worst < replay_tol, summary
    assert equal == len(together) or not same_as_alone, summary
    return summary
