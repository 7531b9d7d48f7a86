"""The benches of tests/bench/ as the tests run them: what each one's JSON must carry, its
timeout and marks (BENCHES), and one run of a bench as its own process group.

    BENCHES            name -> (main keys of its last JSON line, timeout in seconds, marks)
    run_bench          (exit code, stdout, stderr, seconds); a run past its timeout fails the test
    last_json_object   the bench's result: its last stdout line, one JSON object
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.bench_pool import run_process_group

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "tests" / "bench"

# name: (main keys of its JSON, timeout in seconds, marks). Timeouts are ~3x the
# smoke's wall time on an idle 2-core machine: loaded CI machines are slower.
BENCHES = {
    "wire": (("routing_bytes_per_token", "encode_decode_ratio_vs_baseline", "broker_vs_raw_ratio",
              "targets_met"), 180, ("broker",)),
    "trainer": (("samples_per_second", "step_overhead_share", "step_seconds"), 180, ("megatron",)),
    "consumer": (("consumer_wait_share", "checkpoint_seconds", "publish_seconds", "model_bytes",
                  "publish_breakdown", "large", "consumer_wait_share_pipeline"), 240, ("megatron", "broker")),
    "weights_export": (("sizes", "machine"), 240, ("megatron",)),
    "weights": (("collective_vs_file_speedup", "collective_vs_raw_broadcast", "tamper_refused", "delta",
                 "sizes"), 360, ("vllm", "megatron")),
    "producer": (("publish_overhead", "publish_cpu_overhead", "reload_seconds", "verify_seconds",
                  "short_responses", "large"), 360, ("vllm", "broker")),
    "trainer_scale": (("memory_growth_exponent", "bf16_update_rel_error", "step_overhead_share",
                       "rank_ingress_share", "checkpoint_blocking_share"), 420, ("megatron",)),
    "trainer_scale_ranks": (("rank_ingress_share", "checkpoint_blocking_share"), 420, ("megatron",)),
    "soak": (("records_per_s", "lost", "trained_twice", "stall_free", "memory_flat", "step_wait_s"), 480,
             ("vllm", "megatron", "broker")),
    "e2e_async": (("experiment", "arms", "warm_accuracy", "target_accuracy"), 600, ("vllm", "megatron", "broker")),
    "dynamic_sampling": (("experiment", "arms", "warm_accuracy", "target_accuracy"), 600,
                         ("vllm", "megatron", "broker")),
    # about 3x its slower smoke (140 s at load average 12 with a 10 s arm; 72 s with 5 s): load swings the engine start
    "stability": (("losses", "arms", "warm_accuracy", "targets_met"), 420, ("vllm", "megatron", "broker")),
    "cluster": (("versions_trained", "seconds_per_version", "collective_share", "trainer_egress_over_model_bytes"),
                480, ("vllm", "megatron", "broker")),
    "replay": (("replay_equal", "replay_over_original", "export_over_raw_decode", "export_memory_ratio"), 240,
               ("megatron", "broker")),
    # the first run in a checkout also builds .venv-peers (`make peers-install`, ~15-60 s)
    "peers": (("time_to_target_over_trl", "samples_per_s_over_trl", "heldout_at_equal_time", "trl_mode",
               "trl_modes_tried", "runs"), 420, ("vllm", "megatron", "broker")),
    "episodes": (("lost_generation_seconds_per_crash", "lost_ratio_on_over_off", "episodes_published_twice"), 600,
                 ("vllm", "broker")),
    "journal_start": (("start_read_s", "ratio_10x_over_1x", "records_read", "without_checkpoints"), 90, ("broker",)),
    # 51-80 s alone (load 1-10), 106 s in this test (load 3-8): 240, ~3x the slowest
    "hostile": (("crashes", "valid_records_lost", "healthz_p99_s", "trained_twice", "classes", "checks"), 240,
                ("vllm", "megatron", "broker")),
}


def bench_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run_bench(cmd: list[str], timeout_s: float) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds), the bench run alone; on timeout its whole process
    group is killed (its broker, engines and workers too) and the test fails with its stderr's tail."""
    code, out, err, seconds = run_process_group(cmd, timeout_s, ROOT, bench_env())
    if code is None:
        pytest.fail(f"{cmd[1]} --smoke ran past {timeout_s} s:\n{err[-3000:]}")
    return code, out, err, seconds


def last_json_object(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines, "no output on stdout"
    obj = json.loads(lines[-1])
    assert isinstance(obj, dict), f"last line is not a JSON object: {lines[-1][:200]}"
    return obj

