"""test_routing_preemption.py's engine, in a process of its own.

A KV cache of 32 blocks (32 tokens each: 1 MiB, the smallest the settings
allow) for ten requests that grow to 7 blocks each forces vLLM to preempt
running requests (free their KV, recompute it later) as soon as a few of them
run at once. The session engine (tests/fixtures/producer.py, 64 MiB) never
preempts, and a second in-process engine cannot share the test process
(prefix_cache_worker.py says why).

Two runs on the same engine, greedy: every prompt at once (preemption), then
each prompt alone (none). The preemptions are counted by wrapping the
scheduler's `_preempt_request` (vLLM 0.32; the engine runs with
disable_log_stats, so its own counters are off). The samples of both runs go
to OUT (pickle) for the test to check.

    python -m tests.integration.preemption_worker MODEL_DIR OUT [capture|native]

`native` (GPU: tests/gpu/test_producer_gpu.py) runs vLLM's own routed-experts
output instead of CPU capture, with the engine core in this process so that
its scheduler can be wrapped.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

BLOCK, BLOCKS, MAX_TOKENS = 32, 32, 200
PROMPTS = ("12+34=", "7-3+5=", "90-12=", "5+5+5=", "81-9=", "40+45=what?", "3*4=", "100-1=",
           "6+6=", "2+2+2+2=")


def kv_bytes(model_dir: Path) -> int:
    """BLOCKS blocks of the model's fp32 KV: layers x (K, V) x kv heads x head dim x 4 bytes per token."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4
    return BLOCKS * BLOCK * per_token


def count_preemptions(engine) -> dict[str, list[int]]:
    """{vLLM request id: [tokens it had generated at each of its preemptions]}, filled as
    the scheduler preempts."""
    sched = engine._engine.engine_core.engine_core.scheduler
    counts: dict[str, list[int]] = {}
    original = sched._preempt_request

    def preempt(request, *args, **kwargs):
        counts.setdefault(request.request_id, []).append(int(request.num_output_tokens))
        return original(request, *args, **kwargs)

    sched._preempt_request = preempt
    return counts


def generate(engine, prompts, tag: str) -> list:
    from rlstream.producer.sample import SamplingConfig
    from tests.support.engine import run_until_done

    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit_group(engine.encode(p), n=1, tag=f"{tag}-{i}", sampling=sampling)
    return run_until_done(engine, max_steps=20000)


def preemptions_of(request_id: str, counts: dict[str, list[int]]) -> list[int]:
    """Our request id's entries of `count_preemptions` (vLLM's id is ours or "{ours}-{suffix}")."""
    return [n for iid, ns in counts.items() if iid == request_id or iid.startswith(request_id + "-") for n in ns]


def engine_settings(model_dir: Path, routing: str):
    from rlstream.common.config import EngineSettings

    native = {"routing": "native", "enable_prefix_caching": True, "gpu_memory_utilization": 0.3}\
        if routing == "native" else {}
    return EngineSettings(dtype="float32", max_model_len=256, kv_cache_memory_bytes=kv_bytes(model_dir),
                          block_size=BLOCK, max_num_seqs=len(PROMPTS), seed=0, enforce_eager=True, **native)


def main(model_dir: Path, out: Path, routing: str = "capture") -> None:
    import os

    from rlstream.producer.engine import RolloutEngine

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process (capture sets it too)
    settings = engine_settings(model_dir, routing)
    with RolloutEngine(settings, model_dir) as engine:
        assert engine.routing_mode == routing
        counts = count_preemptions(engine)
        together = generate(engine, PROMPTS, "together")
        during = {iid: list(ns) for iid, ns in counts.items()}
        alone = [generate(engine, [p], f"alone{i}")[0] for i, p in enumerate(PROMPTS)]
    result = {"together": together, "alone": alone,
              "preempted_at": {s.request_id: preemptions_of(s.request_id, during) for s in together},
              "preemptions_alone": sum(map(len, counts.values())) - sum(map(len, during.values()))}
    with open(out, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])
