"""The trainer's half of a weight version: export, pack to host, hash. One JSON object.

    .venv/bin/python tests/bench/weights_export.py [--sizes l1g,g2] [--reps 3] [--smoke]

`--smoke`: the tiny model, one round (seconds).

The per-version cost on the trainer before any byte reaches a producer, the
`T_export + S / R_pack_hash` term of docs/weights.md's projection, measured on
the device the trainer runs on (CUDA when there is one: run it on a GPU machine
to measure that term instead of projecting it from the CPU). Per size, a real
Trainer (megatron-core, bf16 parameters, world 1) built from an HF checkpoint
made here (TinyModelSpec, nothing downloaded); per round, after one warm-up:

  source_seconds     iterate `trainer.weight_source()` (the per-group gather/convert;
                     the tensors stay on the trainer's device), synchronized
  fill_seconds       `Snapshot.fill` as the collective path runs it: pack every group
                     into host buffers (reused) and blake3 it, pipelined
  hash_seconds       blake3 of the filled buffers alone (wire.digest, as fill calls it)
  copy_pinned_seconds  (CUDA) the same tensors copied into pinned host buffers alone:
                     what the device-to-host copy can do when the buffers are pinned

Rates are bytes / seconds (GB = 1e9 B). Medians of --reps; `all` has every round.
stdout carries only the JSON; logs go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

log = logging.getLogger("bench.weights_export")
SMOKE = dict(sizes="tiny", reps=1)

EXTRA_SIZES = {  # beyond weights.py's SIZES: ~2.4 GB of bf16 weights (1.2 B parameters)
    "g2": dict(hidden_size=2048, intermediate_size=4096, moe_intermediate_size=768, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32),
}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_size(name: str, overrides: dict, reps: int, models_dir: Path) -> dict:
    import torch

    from rlstream.common.config import ConsumerSettings
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from rlstream.common.weights import wire
    from rlstream.consumer.train.trainer import Trainer
    from rlstream.consumer.weights.snapshot import Snapshot

    t0 = time.perf_counter()
    model_dir = build_tiny_model(models_dir / name, TinyModelSpec(**overrides))
    build_s = time.perf_counter() - t0
    trainer = Trainer.from_hf(model_dir, ConsumerSettings(dtype="bfloat16", group_size=1))
    device = trainer.device
    log.info("%s: built in %.0f s, trainer on %s", name, build_s, device)
    rows, snap = {k: [] for k in ("source", "fill", "hash", "copy_pinned")}, None
    pinned = None
    for r in range(reps + 1):  # round 0 warms buffers and kernels
        t = time.perf_counter()
        tensors = [t_ for _, group in trainer.weight_source().iter_groups() for t_ in group]
        _sync(device)
        source_s = time.perf_counter() - t
        snap = Snapshot(r + 1, trainer.weight_source(), reuse=snap)
        snap.fill()
        t = time.perf_counter()
        for buf in snap.buffers:
            wire.digest(buf)
        hash_s = time.perf_counter() - t
        copy_s = None
        if device.type == "cuda":
            if pinned is None:
                pinned = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in tensors]
            t = time.perf_counter()
            for dst, src in zip(pinned, tensors):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            copy_s = time.perf_counter() - t
        del tensors
        if r:
            for k, v in (("source", source_s), ("fill", snap.fill_seconds), ("hash", hash_s), ("copy_pinned", copy_s)):
                rows[k].append(v)
    nbytes = snap.header.nbytes
    out = {"bytes": nbytes, "device": str(device), "build_s": round(build_s, 1)}
    for k, xs in rows.items():
        xs = [x for x in xs if x is not None]
        if xs:
            med = statistics.median(xs)
            out[f"{k}_seconds"] = round(med, 4)
            out[f"{k}_gb_per_s"] = round(nbytes / med / 1e9, 2)
            out.setdefault("all", {})[k] = [round(x, 4) for x in xs]
    del trainer
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="l1g", help="comma-separated, of weights.py's SIZES and " + ", ".join(EXTRA_SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models-dir", default=str(ROOT / "runs" / "bench-models"))
    args = parse_args(ap, SMOKE)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    saved = os.dup(1)
    os.dup2(2, 1)  # libraries' prints go to stderr; the JSON to the original stdout
    import torch

    from rlstream.consumer.train.parallel import ParallelLayout, init_parallel
    from tests.bench.weights import SIZES

    init_parallel(ParallelLayout())
    sizes = {**SIZES, **EXTRA_SIZES}
    t0 = time.perf_counter()
    results = {n: measure_size(n, sizes[n], args.reps, Path(args.models_dir)) for n in args.sizes.split(",")}
    info = {"cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    os.write(saved, (json.dumps({"bench": "weights_export", "date": time.strftime("%Y-%m-%d"), "sizes": results,
                                 "machine": info, "reps": args.reps, "smoke": args.smoke,
                                 "bench_seconds": round(time.perf_counter() - t0, 1)}) + "\n").encode())


if __name__ == "__main__":
    main()
