"""The trainer at scale, measured on CPU. Prints one JSON object.

    .venv/bin/python tests/bench/trainer_scale.py [--points 2048,4096,8192,16384] [--smoke]

`--smoke`: one point (512 tokens) per curve, so no exponent (null), a vocabulary of 4096, no part B
(`trainer_scale_ranks.py --smoke` covers it).

Issue #14's figures side by side in one run (docs/trainer-scale.md has the
projection of each to Qwen3-30B-A3B):
  memory_growth_exponent  slope of log(peak RSS above idle) against log(tokens
                          per micro-batch), one sequence per micro-batch, on a
                          mid-size MoE; each point is a fresh process running one
                          real `train_step` (old-policy pass, update, optimizer).
                          "scaled": sdpa attention, chunked log-probs (2048),
                          recompute. "unscaled": Megatron's local attention, logits
                          of the whole micro-batch, no recompute (the path before
                          #14); its largest point is skipped when this machine
                          lacks the memory (it grows quadratically). Goal <= 1.2.
  bf16_update_rel_error   tests/support/precision.py: the trainer's bf16 update
                          (fp32 masters) against fp32 AdamW fed the same gradients,
                          lr 1e-6, 10 steps; the plain-bf16 AdamW beside it. Goal <= 1e-2.
  step_overhead_share     share of the step outside forward, backward and optimizer
                          (tiny model, R3, several micro-batches per mini-batch).
                          Goal <= 0.10.
  rank_ingress_share, checkpoint_blocking_share: issue #14 part B, measured by
                          tests/bench/trainer_scale_ranks.py (`figures`) in the same
                          run; `--no-ranks` leaves them null.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

MID = dict(vocab_size=32768, hidden_size=256, moe_intermediate_size=512, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
           num_experts_per_tok=2, max_position_embeddings=32768)
SCALED = {"attention": "sdpa", "logprob_chunk_tokens": 2048, "recompute": True}
UNSCALED = {"attention": "local", "logprob_chunk_tokens": 0, "recompute": False}
SMOKE = dict(points="512", no_ranks=True, vocab=4096)
UNSCALED_MB_PER_TOKEN2 = 4 * 4 * 2 * 2 / 2**20  # layers x heads x (scores, probs) x bf16, MB


# ---------------------------------------------------------------- one memory point (child)


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))


def one_sample(tokens: int, vocab: int, seed: int = 0):
    import numpy as np

    from rlstream.consumer.train.batch import TrainSample

    rng = np.random.default_rng(seed)
    prompt, resp = rng.integers(3, vocab, 16).astype(np.int32), rng.integers(3, vocab, tokens - 15)
    return TrainSample(prompt_ids=prompt, response_ids=resp.astype(np.int32),
                       logprobs=np.full(len(resp), -3.0, np.float32), reward=1.0, group_id="g")


def measure_point(model_dir: str, tokens: int, memory: dict) -> dict:
    """Peak RSS above idle of one train_step on one sequence of `tokens` positions."""
    import torch

    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cfg = ConsumerSettings(group_size=1, dtype="bfloat16", optimizer={"lr": 1e-6},
                           memory={**memory, "micro_batch_tokens": tokens})
    trainer = Trainer.from_hf(model_dir, cfg)
    vocab = trainer.model.hf_dims.vocab_size
    trainer.train_step(trainer.build_batch([one_sample(64, vocab, 1)], 1))  # optimizer state
    gb = trainer.build_batch([one_sample(tokens, vocab)], 1)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    idle, t0 = rss_mb("VmRSS:"), time.perf_counter()
    trainer.train_step(gb)
    return {"tokens": tokens, "peak_above_idle_mb": round(rss_mb("VmHWM:") - idle, 1),
            "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- phases (parent)


def setup(work: Path, spec: dict) -> Path:
    from rlstream.toy.tinymodel import TinyModelSpec, build_tiny_model

    return build_tiny_model(work / "mid", TinyModelSpec(**spec))


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemAvailable"))


def memory_curve(model_dir: Path, points: list[int], memory: dict, quadratic: bool) -> dict:
    rows, skipped = [], []
    for tokens in points:
        need = UNSCALED_MB_PER_TOKEN2 * tokens**2 if quadratic else 0
        if need > 0.6 * available_mb():
            skipped.append(tokens)
            continue
        cmd = [sys.executable, __file__, "--point", str(model_dir), str(tokens), json.dumps(memory)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"points": rows, "skipped_for_memory": skipped, "exponent": slope(rows)}


def slope(rows: list[dict]) -> float | None:
    """Least-squares slope of log(peak) against log(tokens)."""
    xs = [math.log(r["tokens"]) for r in rows]
    ys = [math.log(max(r["peak_above_idle_mb"], 1.0)) for r in rows]
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys))
                 / sum((x - mx) ** 2 for x in xs), 3)


def step_overhead(work: Path) -> dict:
    from rlstream.common.config import ConsumerSettings
    from rlstream.toy.tinymodel import build_tiny_model
    from rlstream.consumer.train.trainer import Trainer
    from tests.bench.trainer import make_rollouts

    cfg = ConsumerSettings(replay="R3", num_minibatches=2, optimizer={"lr": 1e-5},
                           memory={"micro_batch_tokens": 512})
    trainer = Trainer.from_hf(build_tiny_model(work / "tiny"), cfg)
    samples = make_rollouts(trainer.model, 16, 4)
    compute = wall = 0.0
    for step in range(5):
        t0 = time.perf_counter()
        m = trainer.train_step(trainer.build_batch(samples, 4))
        if step >= 2:  # warm
            wall += time.perf_counter() - t0
            compute += m["time_forward"] + m["time_backward"] + m["time_optimizer"]
    micro = len(trainer.build_batch(samples, 4).minibatches[0].micro_batches())
    return {"step_overhead_share": round(1 - compute / wall, 4), "micro_batches": micro}


def precision(work: Path) -> dict:
    from rlstream.toy.tinymodel import build_tiny_model
    from rlstream.consumer.train.parallel import init_parallel
    from tests.support.precision import update_rel_errors

    init_parallel()
    r = update_rel_errors(build_tiny_model(work / "tiny-p"), work, steps=10, lr=1e-6)
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="2048,4096,8192,16384")
    ap.add_argument("--point", nargs=3, metavar=("MODEL_DIR", "TOKENS", "MEMORY_JSON"))
    ap.add_argument("--no-ranks", action="store_true", help="skip part B's figures (about 5 minutes)")
    ap.add_argument("--vocab", type=int, default=MID["vocab_size"], help="vocabulary of the memory curves' MoE")
    args = parse_args(ap, SMOKE)
    if args.point:  # child: one memory point
        print(json.dumps(measure_point(args.point[0], int(args.point[1]), json.loads(args.point[2]))))
        return
    work = Path(tempfile.mkdtemp(prefix="rlstream-scale-"))
    points = [int(p) for p in args.points.split(",")]
    model = {**MID, "vocab_size": args.vocab}
    model_dir = setup(work, model)
    scaled = memory_curve(model_dir, points, SCALED, quadratic=False)
    unscaled = memory_curve(model_dir, points, UNSCALED, quadratic=True)
    prec, overhead = precision(work), step_overhead(work)
    ranks = None if args.no_ranks else rank_figures()
    print(json.dumps({
        "bench": "trainer_scale", "smoke": args.smoke, "model": model, "dtype": "bfloat16",
        "threads": int(os.environ["OMP_NUM_THREADS"]),
        "memory_growth_exponent": scaled["exponent"], "memory_scaled": scaled,
        "memory_growth_exponent_unscaled": unscaled["exponent"], "memory_unscaled": unscaled,
        "bf16_update_rel_error": prec["trainer"], "bf16_update_rel_error_plain_bf16": prec["plain_bf16"],
        "bf16_unmoved_share_plain_bf16": prec["unmoved_share_plain_bf16"],
        "step_overhead_share": overhead["step_overhead_share"],
        "step_overhead_micro_batches": overhead["micro_batches"],
        "rank_ingress_share": ranks and ranks["rank_ingress"]["rank_ingress_share"],
        "checkpoint_blocking_share": ranks and ranks["checkpoint"]["checkpoint_blocking_share"],
        "ranks": ranks,
    }))


def rank_figures() -> dict:
    """Part B's figures with its defaults (tests/bench/trainer_scale_ranks.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trainer_scale_ranks

    return trainer_scale_ranks.figures(trainer_scale_ranks._args([]))


if __name__ == "__main__":
    main()
