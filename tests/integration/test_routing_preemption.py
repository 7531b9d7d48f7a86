"""R3 under preemption: CPU routing capture (producer/routing_capture.py) keeps every
routing row of a request vLLM preempted and recomputed.

tests/integration/preemption_worker.py runs, in its own process, an engine whose KV
cache (1 MiB, 32 blocks) cannot hold ten greedy 200-token requests at once: vLLM
preempts some of them after they generated tokens, frees their KV and recomputes it
(prompt and generated tokens) when they resume. Then it runs each prompt alone (no
preemption). Every sample run together must carry routing rows for every input
position (P + T - 1, the record contract: common/record/), identical to its run
alone, and those rows must replay, in an independent HF implementation, to the
log-probs vLLM reported (test_routing_capture.py's proof).

Why capture holds: it writes rows by position (the runner's num_computed_tokens),
so a recompute rewrites positions 0..n instead of appending them. vLLM's native
routed-experts output (GPU) runs the same check in tests/gpu/test_producer_gpu.py.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_routing_capture import MATCH_TOL, hf_sampled_logprobs, load_hf_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def run_worker(model_dir: Path, tmp: Path, routing: str) -> dict:
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


@pytest.mark.timeout(900)
def test_preempted_requests_keep_complete_and_correct_routing(tiny_model_dir, tmp_path):
    runs = run_worker(tiny_model_dir, tmp_path, "capture")
    print("\npreemption (capture):", check_preempted_routing(runs, tiny_model_dir, MATCH_TOL, same_as_alone=True))
