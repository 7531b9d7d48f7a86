"""Worker for test_multirank.py: one training step on 2 ranks (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 multirank_worker.py MODEL_DIR OUT_DIR

Runs the same step twice: data-parallel 2 (ep 1), then data-parallel 2 with
expert-parallel 2 (each rank holds half the experts). Rank 0 writes the
exported HF tensors of each run to OUT_DIR/{dp2,dp2_ep2}.pt. Every rank builds
the same samples (`make_samples`) and keeps its data-parallel slice.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

CFG = dict(loss="minirl", replay="R2", num_minibatches=2, lr=1e-3, grad_clip=1.0)


def make_samples(seed: int = 0, n_groups: int = 4, group_size: int = 4, vocab: int = 64):
    """Deterministic rollouts: random prompt/response ids and mu_old log-probs."""
    from consumer.batch import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 8))).astype(np.int32)
        for _ in range(group_size):
            t = int(rng.integers(3, 10))
            out.append(TrainSample(
                prompt_ids=prompt, response_ids=rng.integers(3, vocab, size=t).astype(np.int32),
                logprobs=(-rng.uniform(3.0, 5.0, size=t)).astype(np.float32),
                reward=float(rng.integers(0, 2)), group_id=f"g{g}"))
    return out


def run(model_dir: str, ep: int):
    from consumer.trainer import Trainer, TrainerConfig

    trainer = Trainer.from_hf(model_dir, TrainerConfig(dp=2, ep=ep, **CFG))
    metrics = trainer.train_step(trainer.build_batch(make_samples(), group_size=4))
    return trainer.export_hf_state_dict(), metrics


def main(model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    for name, ep in (("dp2", 1), ("dp2_ep2", 2)):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        sd, metrics = run(model_dir, ep)
        if dist.get_rank() == 0:
            torch.save({"state": sd, "metrics": metrics}, Path(out_dir) / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
