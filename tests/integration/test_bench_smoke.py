"""Every benchmark runs at smoke size, so none rots unnoticed (issue 24, item 6).

Each script in tests/bench/ runs as a subprocess, exactly as a person would
run it (`python tests/bench/X.py --smoke`, OMP_NUM_THREADS=1, the repository
on PYTHONPATH), with a timeout of its own; the test checks that it exits 0
and that its last stdout line is one JSON object carrying the bench's main
keys. The figures of a smoke run mean nothing and are not checked. A new
script in tests/bench/ fails `test_every_bench_is_listed` until it is added
to BENCHES below (modules starting with `_` are helpers, not benches).

The smokes run two at a time (tests/support/bench_pool.py; RLSTREAM_SMOKE_LANES=1
runs them one by one): they spend much of their time waiting on fixed
durations, timeouts and service starts, so two share the cores with little
loss. Each still runs alone in its own process group with its own timeout.

Wall time on a shared 2-core machine: docs/benchmarks.md ("Smoke runs").
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.bench_pool import Job, SmokePool, run_process_group

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


RUN_ELSEWHERE = {"episodes": "tests/integration/test_episode_crash.py asserts on its smoke run"}
"""Benches whose smoke run is an integration test of its own (run once, not twice)."""


def test_every_bench_is_listed():
    scripts = {p.stem for p in BENCH_DIR.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(BENCHES), f"tests/bench/ and BENCHES differ: {scripts ^ set(BENCHES)}"


def test_smoke_replaces_defaults_and_explicit_flags_win():
    import argparse

    from tests.bench._smoke import parse_args

    def parser():
        ap = argparse.ArgumentParser()
        ap.add_argument("--reps", type=int, default=10)
        ap.add_argument("--sizes", default="tiny,l1g")
        return ap

    smoke = {"reps": 1, "sizes": "tiny"}
    full = parse_args(parser(), smoke, [])
    assert (full.smoke, full.reps, full.sizes) == (False, 10, "tiny,l1g")
    small = parse_args(parser(), smoke, ["--smoke"])
    assert (small.smoke, small.reps, small.sizes) == (True, 1, "tiny")
    mixed = parse_args(parser(), smoke, ["--reps", "3", "--smoke"])
    assert (mixed.reps, mixed.sizes) == (3, "tiny")


@pytest.fixture(scope="module")
def shared_warm(tmp_path_factory) -> list[str]:
    """The experiment benches share one model, task and SFT warm start (the second reuses it)."""
    d = tmp_path_factory.mktemp("bench-warm")
    return ["--set", f"model.path={d}/tiny-model", "--set", f"producer.prompts.path={d}/data/train.jsonl",
            "--set", f"demo.work_dir={d}/demo"]


def extra_args(name: str, tmp_path: Path, shared_warm: list[str]) -> list[str]:
    """Where each bench writes (the test's temporary directories, not runs/)."""
    if name in ("weights", "weights_export"):
        return ["--models-dir", str(tmp_path / "models")]
    if name in ("soak", "hostile"):
        return ["--work-dir", str(tmp_path / name)]
    if name == "peers":
        return ["--work-dir", str(tmp_path / "peers")]
    if name in ("e2e_async", "dynamic_sampling", "stability"):
        return shared_warm
    return []


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


LANES = int(os.environ.get("RLSTREAM_SMOKE_LANES", "2"))
"""Smokes run at once (tests/support/bench_pool.py); 1 runs them one after another."""

ORDER = ("weights", "e2e_async", "peers", "dynamic_sampling", "soak", "stability", "hostile", "cluster",
         "trainer_scale", "trainer_scale_ranks", "producer", "replay", "consumer", "weights_export", "trainer",
         "journal_start", "wire")
"""The tests' order, and so the pool's: longest first (CI, 2026-11-27), so that two lanes end together;
the experiment benches apart, since they run one at a time (their shared warm start)."""

EXPERIMENTS = ("e2e_async", "dynamic_sampling", "stability")


def test_the_order_lists_every_smoke_of_this_test():
    assert sorted(ORDER) == sorted(n for n in BENCHES if n not in RUN_ELSEWHERE)


@pytest.fixture(scope="module")
def smoke_pool(request, tmp_path_factory, shared_warm):
    """One pool for the module: the smokes the session selected, started in ORDER."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and item.originalname == "test_bench_smoke"}
    jobs = []
    for name in ORDER:
        if name in selected:
            cmd = [sys.executable, str(BENCH_DIR / f"{name}.py"), "--smoke",
                   *extra_args(name, tmp_path_factory.mktemp(f"smoke-{name}"), shared_warm)]
            jobs.append(Job(name, cmd, BENCHES[name][1], group="experiments" if name in EXPERIMENTS else ""))
    pool = SmokePool(jobs, LANES, ROOT, bench_env())
    yield pool
    pool.stop()


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # pytest's own timeout: the bench's, plus fixtures and teardown
    pytest.param(name, marks=[pytest.mark.timeout(BENCHES[name][1] + 120),
                              *(getattr(pytest.mark, m) for m in BENCHES[name][2])])
    for name in ORDER])
def test_bench_smoke(name, smoke_pool):
    keys, timeout_s, _ = BENCHES[name]
    run = smoke_pool.wait(name, timeout_s + 60)
    # shown with -s / -rP: the smoke budget in docs/benchmarks.md
    print(f"{name} --smoke: {run.seconds:.1f} s (started {run.started_at:.0f} s into the pool, {LANES} lanes)")
    assert run.code is not None, f"{name} --smoke ran past {timeout_s} s:\n{run.err[-3000:]}"
    assert run.code == 0, f"{name} --smoke exited {run.code}:\n{run.err[-3000:]}"
    result = last_json_object(run.out)
    if "skipped" in result:  # cluster.py without root or iproute2: it says why
        pytest.skip(result["skipped"])
    missing = [k for k in keys if k not in result]
    assert not missing, f"{name} --smoke JSON lacks {missing}: {sorted(result)}"
    if "experiment" not in result:  # the experiment benches print the harness's JSON as it is
        assert result.get("smoke") is True, f"{name} --smoke JSON does not say smoke: true"
