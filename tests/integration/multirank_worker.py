"""Worker for test_multirank.py: one training step on 2 ranks (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 multirank_worker.py MODEL_DIR OUT_DIR [LAYOUT ...]

Runs the same step once per layout (default: every 2-rank layout of LAYOUTS):
data-parallel 2, data-parallel 2 with expert-parallel 2 (each rank holds half
the experts), tensor-parallel 2 (sequence parallel; each rank holds half of
every matrix) with Routing Replay R2 and R3, and on 4 ranks all three at
once. Rank 0 writes the exported HF tensors and metrics of
each run to OUT_DIR/<layout>.pt. Every rank builds the same samples
(`make_samples`) and keeps its data-parallel slice.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

# the `consumer` settings of every run (common/config.py)
CFG = dict(loss={"name": "minirl"}, num_minibatches=2, optimizer={"name": "sgd", "lr": 0.05, "grad_clip": 1.0})
# layout -> (world size, consumer.parallel, replay mode); data-parallel size = world / tensor
LAYOUTS = {"dp2": (2, {}, "R2"), "dp2_ep2": (2, {"expert": 2}, "R2"),
           "tp2": (2, {"tensor": 2}, "R2"), "tp2_r3": (2, {"tensor": 2}, "R3"),
           "tp2_dp2_ep2": (4, {"tensor": 2, "expert": 2}, "R3")}  # 4 ranks


def world_size(layout: str) -> int:
    return LAYOUTS[layout][0]


def make_samples(model_dir: str, seed: int = 2, n_groups: int = 4, group_size: int = 4):
    """Deterministic rollouts: random prompt/response ids, mu_old log-probs and
    routing (distinct random experts per input position and layer). With seed
    2 the two mini-batches have 14 and 11 input positions, so tensor
    parallelism pads one of them (test_multirank checks). Groups are sampled
    at temperatures 0.7, 1.0 and 1.3 in turn, so the vocabulary-parallel
    log-probs under TP are taken at each row's temperature too."""
    from consumer.batch import TrainSample
    from consumer.model import read_hf_dims

    dims = read_hf_dims(model_dir)
    vocab, n_layers, n_exp, k = dims.vocab_size, dims.num_layers, dims.num_experts, dims.topk
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 8))).astype(np.int32)
        for _ in range(group_size):
            t = int(rng.integers(3, 10))
            positions = len(prompt) + t - 1
            routing = np.argsort(rng.random((positions, n_layers, n_exp)), -1)[..., :k]
            out.append(TrainSample(
                prompt_ids=prompt, response_ids=rng.integers(3, vocab, size=t).astype(np.int32),
                logprobs=(-rng.uniform(3.0, 5.0, size=t)).astype(np.float32),
                reward=float(rng.integers(0, 2)), group_id=f"g{g}",
                routed_experts=routing.astype(np.uint8), temperature=(0.7, 1.0, 1.3)[g % 3]))
    return out


def trainer_config(layout: str, one_rank: bool = False):
    """The layout's settings; `one_rank`: the same step in a world of one (the reference)."""
    from common.config import ConsumerSettings

    _, parallel, replay = LAYOUTS[layout]
    return ConsumerSettings(replay=replay, parallel={} if one_rank else parallel, **CFG)


def run(model_dir: str, layout: str):
    from consumer.trainer import Trainer

    from consumer.model import forward_logits

    trainer = Trainer.from_hf(model_dir, trainer_config(layout))
    metrics = trainer.train_step(trainer.build_batch(make_samples(model_dir), group_size=4))
    # under TP each rank holds only its vocabulary shard of the logits
    metrics["logit_columns"] = forward_logits(trainer.model, torch.tensor([[5, 6, 7]])).shape[-1]
    return trainer.export_hf_state_dict(), metrics


def main(model_dir: str, out_dir: str, layouts: list[str]) -> None:
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    for layout in layouts or [k for k in LAYOUTS if world_size(k) == world]:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        sd, metrics = run(model_dir, layout)
        if dist.get_rank() == 0:
            torch.save({"state": sd, "metrics": metrics}, Path(out_dir) / f"{layout}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
