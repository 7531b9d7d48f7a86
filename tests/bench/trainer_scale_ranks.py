"""Trainer at scale, part B (issue #14): the rank protocol and checkpoint figures. Prints one JSON object.

    .venv/bin/python tests/bench/trainer_scale_ranks.py [--steps 30] [--threads 1] [--no-ingress] [--smoke]

`--smoke`: one ingress step; one step of the mid-size MoE with 2 experts instead of 32 and a
checkpoint after it, one synchronous step. `--no-ingress`: the checkpoint figure alone.

rank_ingress_share         bytes a follower receives per step on the control channel (commands and its
                           batch share) / bytes of its own share's samples (record arrays, plus an
                           advantage and a weight each); dp = 2: torchrun, gloo, 2 CPU processes, the tiny
                           model, 8 groups x 4 responses of 200-400 tokens with R3 routing, 2 mini-batches.
                           Goal <= 1.1. `before` is what the old broadcast of the whole sample list
                           delivered to every rank at the least (the batch's sample bytes; the pickle
                           added its framing), over the same yardstick.
checkpoint_blocking_share  seconds the loop blocks on checkpoints / seconds of all steps (train +
                           checkpoint), at the default cadence (consumer.checkpoint), world 1, a mid-size
                           MoE (hidden 512, 4 layers, 32 experts, AdamW state: ~650 MB per checkpoint).
                           Goal <= 0.05. `before`: a synchronous checkpoint after every step (the path
                           before issue #14), over a few steps.

`figures(args)` returns both (tests/bench/trainer_scale.py includes them); stdout carries only the
JSON, logs go to stderr. The machine's load average is reported: the figures are shares of wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

MID_SPEC = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                num_experts_per_tok=4)
SMOKE = dict(steps=1, before_steps=1, ingress_steps=1, experts=2, checkpoint_every=1)
INGRESS_CFG = dict(group_size=4, groups_per_batch=8, num_minibatches=2, replay="R3",
                   optimizer={"name": "sgd", "lr": 1e-3})


def long_samples(dims, n_groups: int, group_size: int, seed: int, resp=(200, 400), prompt_len: int = 64):
    """Rollouts of realistic length: routing rows for every input position (uint8)."""
    import numpy as np

    from rlstream.consumer.train.batch import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(3, dims.vocab_size, prompt_len).astype(np.int32)
        for i in range(group_size):
            t = int(rng.integers(*resp))
            rows = prompt_len + t - 1
            routing = np.argsort(rng.random((rows, dims.num_layers, dims.num_experts)), -1)[..., :dims.topk]
            out.append(TrainSample(prompt, rng.integers(3, dims.vocab_size, t).astype(np.int32),
                                   -rng.uniform(0.5, 4.0, t).astype(np.float32), float(i % 2), f"s{seed}-g{g}",
                                   routing.astype(np.uint8)))
    return out


# ---------------------------------------------------------------------------- ingress (torchrun worker)

def ingress_worker(model_dir: str, out: str, steps: int) -> None:
    """One rank of the dp2 run: rank 0 leads `steps` steps, rank 1 follows and counts."""
    import torch
    from megatron.core import parallel_state as ps

    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.ranks.channel import RankChannel
    from rlstream.consumer.checkpoint.files import CheckpointManager
    from rlstream.consumer.ranks.protocol import Follower, Leader
    from rlstream.consumer.ranks.shares import sample_bytes
    from rlstream.consumer.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer.from_hf(model_dir, ConsumerSettings(**INGRESS_CFG))
    channel = RankChannel(ps.get_data_parallel_rank())
    batches = [long_samples(trainer.model.hf_dims, 8, 4, seed=s) for s in range(steps)]
    ckpt = CheckpointManager(Path(out) / "ckpt")
    if channel.rank == 0:
        leader = Leader(trainer, ckpt, 4, channel)
        for b in batches:
            leader.train(b)
        leader.stop()
        return
    Follower(trainer, ckpt, channel).run()
    shares = [trainer.split_batch(b, 4) for b in batches]
    (Path(out) / "ingress.json").write_text(json.dumps({
        "received_bytes": channel.received_bytes,
        "own_share_bytes": sum(sample_bytes(s[ps.get_data_parallel_rank()]) for s in shares),
        "batch_bytes": sum(sample_bytes(x) for s in shares for x in s)}))


def rank_ingress(args, tmp: Path) -> dict:
    from rlstream.toy.tinymodel import build_tiny_model

    model_dir = build_tiny_model(tmp / "tiny")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", __file__, "--worker",
                           str(model_dir), str(tmp), str(args.ingress_steps)], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"ingress run failed:\n{proc.stderr[-3000:]}")
    m = json.loads((tmp / "ingress.json").read_text())
    return {"rank_ingress_share": round(m["received_bytes"] / m["own_share_bytes"], 4),
            "rank_ingress_share_before": round(m["batch_bytes"] / m["own_share_bytes"], 4),
            "bytes_per_step": {k: m[k] // args.ingress_steps for k in m},
            "steps": args.ingress_steps, "dp": 2, "seconds": round(time.perf_counter() - t0, 1),
            "batch": "8 groups x 4, prompt 64, responses 200-400 tokens, routing [P+T-1, 2, 2] uint8"}


# ---------------------------------------------------------------------------- checkpoints (world 1)

def checkpoint_blocking(args, tmp: Path) -> dict:
    import torch

    from rlstream.common.config import ConsumerSettings
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model
    from rlstream.consumer.checkpoint.cadence import Cadence
    from rlstream.consumer.checkpoint.files import CheckpointManager, CheckpointState
    from rlstream.consumer.ranks.protocol import Leader
    from rlstream.consumer.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    cadence_cfg = {} if args.checkpoint_every is None else {"checkpoint": {"every_steps": args.checkpoint_every}}
    cfg = ConsumerSettings(group_size=4, groups_per_batch=4, num_threads=args.threads, **cadence_cfg)
    spec = {**MID_SPEC, "num_experts": args.experts,
            "num_experts_per_tok": min(args.experts, MID_SPEC["num_experts_per_tok"])}
    trainer = Trainer.from_hf(build_tiny_model(tmp / "mid", TinyModelSpec(**spec)), cfg)
    samples = long_samples(trainer.model.hf_dims, 4, 4, seed=0, resp=(96, 160), prompt_len=32)
    for s in samples:
        s.routed_experts = None  # replay none: the figure is about checkpoints
    ckpt = CheckpointManager(tmp / "ckpt", keep=2)
    leader, cadence = Leader(trainer, ckpt, 4), Cadence(cfg.checkpoint)
    trainer.train_step(trainer.build_batch(samples, 4))  # warm
    train_s, block_s, taken = [], [], 0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        leader.train(samples)
        t1 = time.perf_counter()
        if cadence.due(step):  # what ConsumerService.checkpoint does at a step boundary
            leader.checkpoint(CheckpointState(step, step, {0: 0}, runs=[["bench", 0]]))
            cadence.done(step)
            taken += 1
        train_s.append(t1 - t0)
        block_s.append(time.perf_counter() - t1)
        print(f"step {step}: train {t1 - t0:.2f} s, checkpoint {block_s[-1]:.3f} s", file=sys.stderr)
    t0 = time.perf_counter()
    leader.stop()  # shutdown waits for the write in flight
    shutdown_s = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in ckpt.latest()[1].iterdir())
    before = sync_every_step(trainer, samples, ckpt, args.before_steps)
    return {"checkpoint_blocking_share": round(sum(block_s) / (sum(train_s) + sum(block_s)), 4),
            "checkpoint_blocking_share_before": before["share"],
            "cadence": cfg.checkpoint.model_dump(), "steps": args.steps, "checkpoints": taken,
            "step_seconds_median": round(sorted(train_s)[len(train_s) // 2], 3),
            "blocking_seconds_per_checkpoint": round(sum(block_s) / max(taken, 1), 3),
            "sync_checkpoint_seconds": before["seconds"], "checkpoint_bytes": nbytes,
            "shutdown_wait_seconds": round(shutdown_s, 3), "model": f"MoE {spec}, fp32, AdamW"}


def sync_every_step(trainer, samples, ckpt, steps: int) -> dict:
    """The old path: train, then a synchronous checkpoint, every step."""
    from rlstream.consumer.checkpoint.files import CheckpointState

    train_s, save_s = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(trainer.build_batch(samples, 4))
        t1 = time.perf_counter()
        ckpt.save(CheckpointState(1000 + step, 1000 + step, {0: 0}), trainer.state_dict())
        train_s.append(t1 - t0)
        save_s.append(time.perf_counter() - t1)
    return {"share": round(sum(save_s) / (sum(train_s) + sum(save_s)), 4),
            "seconds": round(sum(save_s) / steps, 3)}


# ---------------------------------------------------------------------------- main

def figures(args) -> dict:
    """Both figures (tests/bench/trainer_scale.py calls this)."""
    tmp = Path(tempfile.mkdtemp(prefix="rlstream-bench-ranks-"))
    load0 = os.getloadavg()[0]
    out = {"rank_ingress": None if args.no_ingress else rank_ingress(args, tmp),
           "checkpoint": checkpoint_blocking(args, tmp)}
    out["load_average"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
    return out


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="checkpoint figure: steps at the default cadence")
    ap.add_argument("--before-steps", type=int, default=4, help="steps with a synchronous checkpoint each")
    ap.add_argument("--ingress-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-ingress", action="store_true", help="skip rank_ingress_share (the torchrun run)")
    ap.add_argument("--experts", type=int, default=MID_SPEC["num_experts"],
                    help="experts of the checkpoint figure's MoE (32: ~215 MB of weights)")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="checkpoint cadence in steps (default: consumer.checkpoint's, 10; --steps must reach it)")
    return parse_args(ap, SMOKE, argv)


def main() -> None:
    import logging

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        ingress_worker(*sys.argv[2:4], int(sys.argv[4]))
        return
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    args = _args()
    f = figures(args)
    print(json.dumps({"bench": "trainer_scale_ranks", "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
                      "rank_ingress_share": f["rank_ingress"] and f["rank_ingress"]["rank_ingress_share"],
                      "checkpoint_blocking_share": f["checkpoint"]["checkpoint_blocking_share"], **f}))


if __name__ == "__main__":
    main()
