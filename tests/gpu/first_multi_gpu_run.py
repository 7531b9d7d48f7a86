"""The first multi-GPU run of the weight path: four checks, in order, each PASS or FAIL.

    .venv/bin/python tests/gpu/first_multi_gpu_run.py [--model-dir DIR] [--only N]   # exit 0: all passed

The same code the CPU suite runs over the GPU stand-ins (common/gpu_standin/), here on
real GPUs with real NCCL (RLSTREAM_GPU_STANDIN must be unset):

1. a TP=2 producer takes versions over NCCL: a vLLM engine at tensor_parallel_size 2
   (GPUs 0 and 1) and the trainer (the last GPU) in one process; two versions, each
   loaded by vLLM's packed receive and computing exactly what a file reload computes
   (tests/integration/weights_tp2_worker.py nccl). Needs 3 GPUs.
2. two producers in one fan-out group, 3. one of them SIGKILLed mid-version: the
   trainer (GPU 0) sends to a TP=2 producer (GPUs 1, 2) and a TP=1 producer (GPU 3)
   through vLLM's NCCL engines, the group forms, the killed producer costs the other at
   most one timeout (tests/integration/test_weight_nccl.py). Needs 4 GPUs.
4. a resume with optimizer offload 0.5 on CUDA: Megatron's HybridDeviceOptimizer saved and
   loaded, masters and moments exact, the next step runs
   (tests/gpu/test_trainer_gpu.py::test_checkpoint_round_trip_on_cuda). Needs 1 GPU.

Never run here: no machine with more than one GPU is lent to this project
(docs/gpu.md, "First multi-GPU run"). Each check prints its command; a FAIL prints the
last lines of its output.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def checks(model_dir: Path, tmp: Path) -> list[tuple[str, int, list[str]]]:
    """(what, GPUs it needs, command)."""
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return [
        ("a TP=2 producer takes versions over NCCL", 3,
         [PY, "-m", "tests.integration.weights_tp2_worker", str(model_dir), str(tmp / "tp2"), "nccl"]),
        ("two producers in one fan-out group, one SIGKILLed mid-version", 4,
         [*pytest, "tests/integration/test_weight_nccl.py"]),
        ("(3 is part of 2: the killed producer costs the other at most one timeout)", 0, []),
        ("a resume with optimizer offload 0.5", 1,
         [*pytest, "tests/gpu/test_trainer_gpu.py", "-k", "checkpoint_round_trip and 0.5"]),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="an HF model dir (default: the tiny model, built)")
    ap.add_argument("--only", type=int, help="run check N alone")
    args = ap.parse_args()
    import torch

    if os.environ.get("RLSTREAM_GPU_STANDIN"):
        sys.exit("unset RLSTREAM_GPU_STANDIN: this run is for real GPUs")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tmp = Path(tempfile.mkdtemp(prefix="rlstream-first-run-"))
    model_dir = args.model_dir
    if model_dir is None:
        from rlstream.toy.tinymodel import build_tiny_model

        model_dir = build_tiny_model(tmp / "tiny")
    failed = 0
    for n, (what, need, cmd) in enumerate(checks(model_dir, tmp), 1):
        if (args.only and n != args.only) or not cmd:
            continue
        if gpus < need:
            print(f"{n}. FAIL {what}: needs {need} GPUs, this machine has {gpus}", flush=True)
            failed += 1
            continue
        print(f"{n}. ... {what}: {' '.join(cmd)}", flush=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="4")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        ok = proc.returncode == 0
        failed += not ok
        print(f"{n}. {'PASS' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            print((proc.stdout + proc.stderr)[-3000:], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
