"""R3 under preemption: CPU routing capture (producer/routing_capture.py) keeps every
routing row of a request vLLM preempted and recomputed.

tests/integration/preemption_worker.py runs, in its own process, an engine whose KV
cache (1 MiB, 32 blocks) cannot hold ten greedy 200-token requests at once: vLLM
preempts some of them after they generated tokens, frees their KV and recomputes it
(prompt and generated tokens) when they resume. Then it runs each prompt alone (no
preemption). Every sample run together must carry routing rows for every input
position (P + T - 1, the record contract: common/record/), identical to its run
alone, and those rows must replay, in an independent HF implementation, to the
log-probs vLLM reported (test_routing_capture.py's proof; tests/support/preemption.py runs and checks).

Why capture holds: it writes rows by position (the runner's num_computed_tokens),
so a recompute rewrites positions 0..n instead of appending them. vLLM's native
routed-experts output (GPU) runs the same check in tests/gpu/test_producer_gpu.py.
"""
from __future__ import annotations

import pytest

from tests.support.hf_reference import MATCH_TOL
from tests.support.preemption import check_preempted_routing, run_preemption_worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_preempted_requests_keep_complete_and_correct_routing(tiny_model_dir, tmp_path):
    runs = run_preemption_worker(tiny_model_dir, tmp_path, "capture")
    print("\npreemption (capture):", check_preempted_routing(runs, tiny_model_dir, MATCH_TOL, same_as_alone=True))
