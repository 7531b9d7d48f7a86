"""Every benchmark runs at smoke size, so none rots unnoticed.

Each script in tests/bench/ runs as a subprocess, exactly as a person would
run it (`python tests/bench/X.py --smoke`, OMP_NUM_THREADS=1, the repository
on PYTHONPATH), with a timeout of its own; the test checks that it exits 0
and that its last stdout line is one JSON object carrying the bench's main
keys. The figures of a smoke run mean nothing and are not checked. A new
script in tests/bench/ fails `test_every_bench_is_listed` until it is added
to BENCHES (tests/support/benches.py; modules starting with `_` are helpers, not benches).

The smokes run two at a time (tests/support/bench_pool.py; RLSTREAM_SMOKE_LANES=1
runs them one by one): they spend much of their time waiting on fixed
durations, timeouts and service starts, so two share the cores with little
loss. Each still runs alone in its own process group with its own timeout.

Wall time on a shared 2-core machine: docs/benchmarks.md ("Smoke runs").
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.bench_pool import Job, SmokePool
from tests.support.benches import BENCH_DIR, BENCHES, ROOT, bench_env, last_json_object

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
