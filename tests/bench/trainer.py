"""Trainer throughput on the tiny model (CPU). Prints one JSON object.

    .venv/bin/python tests/bench/trainer.py [--steps 5] [--replay R3] [--smoke]

The data is ready before timing starts (rollouts with routing, as decoded from
Kafka). Each timed step = build_global_batch + train_step.
  samples_per_second   responses trained per wall-clock second
  step_overhead_share  share of the step outside forward, backward and the
                       optimizer (batch building, loss bookkeeping, replay
                       plumbing, metrics); target <= 0.10
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.bench._smoke import parse_args  # noqa: E402

SMOKE = dict(steps=2, warmup=1, groups=4)


def make_rollouts(model, n_groups: int, group_size: int, seed: int = 0) -> list:
    """Random prompts/responses; mu_old and routing from one recording forward."""
    from rlstream.consumer.train import replay
    from rlstream.consumer.train.batch import TrainSample
    from rlstream.consumer.train.model import per_token_logprobs

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(3, 64, size=int(rng.integers(8, 17)))
        lengths = rng.integers(16, 49, size=group_size)
        for j in range(group_size):
            resp = rng.integers(3, 64, size=int(lengths[j]))
            seq = torch.from_numpy(np.concatenate([prompt, resp]))[None].long()
            with torch.no_grad(), replay.recording(model) as rec:
                lp = per_token_logprobs(model, seq)
            routing = replay.from_layer_indices(rec["layers"], 1)[0]
            p = len(prompt)
            out.append(TrainSample(
                prompt_ids=prompt.astype(np.int32), response_ids=resp.astype(np.int32),
                logprobs=(lp[0, p - 1:] - 0.01).numpy().astype(np.float32),
                reward=float(rng.integers(0, 2)), group_id=f"g{g}",
                routed_experts=routing.numpy().astype(np.uint8)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--replay", default="R3")
    ap.add_argument("--loss", default="minirl")
    args = parse_args(ap, SMOKE)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from rlstream.toy.tinymodel import build_tiny_model
    from rlstream.consumer.train.batch import build_global_batch
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="rlstream-bench-")) / "tiny")
    cfg = ConsumerSettings(loss={"name": args.loss}, replay=args.replay, num_minibatches=args.minibatches,
                           optimizer={"lr": 1e-5})
    trainer = Trainer.from_hf(model_dir, cfg)
    samples = make_rollouts(trainer.model, args.groups, args.group_size)

    totals = {"wall": 0.0, "compute": 0.0, "build": 0.0}
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        gb = build_global_batch(samples, args.group_size, cfg.num_minibatches,
                                trainer.advantage_mode)
        t1 = time.perf_counter()
        m = trainer.train_step(gb)
        t2 = time.perf_counter()
        if step >= args.warmup:
            totals["wall"] += t2 - t0
            totals["build"] += t1 - t0
            totals["compute"] += m["time_forward"] + m["time_backward"] + m["time_optimizer"]
    n = len(samples) * args.steps
    print(json.dumps({
        "bench": "trainer", "model": "tiny-qwen3-moe (2 layers, 8 experts, top-2)",
        "replay": args.replay, "loss": args.loss, "responses_per_step": len(samples),
        "minibatches": args.minibatches, "steps": args.steps,
        "tokens_per_step": int(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)),
        "samples_per_second": round(n / totals["wall"], 2),
        "step_seconds": round(totals["wall"] / args.steps, 4),
        "batch_build_share": round(totals["build"] / totals["wall"], 4),
        "step_overhead_share": round(1 - totals["compute"] / totals["wall"], 4),
        "threads": torch.get_num_threads(), "smoke": args.smoke,
    }))


if __name__ == "__main__":
    main()
