"""The trainer's multi-rank worker (tests/integration/multirank_worker.py) under torchrun:
CPU processes on gloo, one run per set of layouts, each layout's results saved as a .pt.

    run_worker_layouts   torchrun the worker on nproc ranks (its default layouts for nproc, or those named)
    run_worker           the same, then every layout of that world size, loaded
    load_worker          the worker script as a module (its LAYOUTS, world_size, make_samples)
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "multirank_worker.py"


def load_worker():
    spec = importlib.util.spec_from_file_location("multirank_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_worker_layouts(model_dir, out, nproc: int, layouts: list[str] = ()) -> None:
    """torchrun the worker on `nproc` ranks (layouts: its default ones for nproc)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(nproc), str(WORKER),
           str(model_dir), str(out), *layouts]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def run_worker(model_dir, out, nproc: int) -> dict:
    run_worker_layouts(model_dir, out, nproc)
    worker = load_worker()
    return {name: torch.load(out / f"{name}.pt", weights_only=False)
            for name in worker.LAYOUTS if worker.world_size(name) == nproc}
