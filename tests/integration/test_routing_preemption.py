"""R3 under preemption: CPU routing capture (producer/routing_capture.py) keeps every
routing row of a request vLLM preempted and recomputed.

tests/integration/preemption_worker.py runs, in its own process, an engine whose KV
cache (1 MiB, 32 blocks) cannot hold ten greedy 200-token requests at once: vLLM
preempts some of them after they generated tokens, frees their KV and recomputes it
(prompt and generated tokens) when they resume. Then it runs each prompt alone (no
preemption). Every sample run together must carry routing rows for every input
position (P + T - 1, the record contract: common/record.py), identical to its run
alone, and those rows must replay, in an independent HF implementation, to the
log-probs vLLM reported (test_routing_capture.py's proof).

Why capture holds: it writes rows by position (the runner's num_computed_tokens),
so a recompute rewrites positions 0..n instead of appending them. vLLM's native
capture (GPU) is not exercised here.
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


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("preemption") / "samples.pkl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "tests.integration.preemption_worker", str(tiny_model_dir), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.mark.timeout(900)
def test_preempted_requests_keep_complete_and_correct_routing(runs, tiny_model_dir):
    together = sorted(runs["together"], key=lambda s: s.tag)
    alone = runs["alone"]
    preempted = {rid: at for rid, at in runs["preempted_at"].items() if at}
    # the premise: vLLM did preempt requests that had generated tokens, and none when alone
    assert any(n > 0 for at in preempted.values() for n in at), runs["preempted_at"]
    assert runs["preemptions_alone"] == 0
    model = load_hf_model(tiny_model_dir)
    L, K = model.config.num_hidden_layers, model.config.num_experts_per_tok
    worst = 0.0
    for s, ref in zip(together, alone):
        P, T = s.prompt_ids.size, s.response_ids.size
        assert s.routed_experts.shape == (P + T - 1, L, K), s.request_id
        np.testing.assert_array_equal(s.response_ids, ref.response_ids)
        np.testing.assert_array_equal(s.routed_experts, ref.routed_experts, err_msg=s.request_id)
        if s.request_id in preempted:
            hf = hf_sampled_logprobs(model, s, routing=s.routed_experts)
            worst = max(worst, float(np.abs(hf - s.logprobs).max()))
    print(f"\npreemption: {len(preempted)} of {len(together)} requests preempted "
          f"(tokens generated at preemption: {sorted(n for at in preempted.values() for n in at)}); "
          f"routing rows equal to the runs alone; HF replay max |diff| = {worst:.3g}")
    assert worst < MATCH_TOL
