"""Worker for test_multirank.py and test_trainer_collectives.py: one training
step on 2 or 4 ranks (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 multirank_worker.py MODEL_DIR OUT_DIR [LAYOUT ...]

Runs the same step once per layout (default: every layout of LAYOUTS for this
world size): data-parallel 2, data-parallel 2 with expert-parallel 2 (each rank
holds half the experts), tensor-parallel 2 (sequence parallel; each rank holds
half of every matrix) with Routing Replay R2 and R3, and on 4 ranks all three
at once. The ranks cut their mini-batches into micro-batches (MICRO_BATCH_TOKENS);
the one-process reference does not. Rank 0 writes the exported HF tensors and
metrics of each run to OUT_DIR/<layout>.pt, with two checks of the run's own:
under tensor parallelism chunked == full-vocabulary log-probs (values and
gradients), and under data parallelism a checkpoint round trip of the
distributed optimizer (every rank's masters and moments restored bit-exactly).
A layout named `audit-<layout>` records every collective of the step instead
(tests/support/collectives.py) into OUT_DIR/audit-<layout>.pt.
Every rank builds the same samples (`make_samples`) and keeps its data-parallel slice.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from tests.support.state import tensors_of

# the `consumer` settings of every run (common/config/consumer.py). Adam with a large eps:
# the first step is lr * g / (|g| + eps) ~ 0.05 g, linear in the gradient, so
# summation-order noise shows 1:1 (a small eps makes the step ~lr * sign(g) and
# turns noise in near-zero gradients into ~1e-4 differences). adamw runs the
# distributed optimizer (the default), sharded over the data-parallel ranks.
CFG = dict(loss={"name": "minirl"}, num_minibatches=2,
           optimizer={"name": "adamw", "lr": 0.5, "eps": 10.0, "grad_clip": 1.0})
MICRO_BATCH_TOKENS = 24
"""Every rank's mini-batch slice (4-8 rows of 11-14 positions) becomes 2-4 micro-batches."""
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
    from rlstream.consumer.train.batch import TrainSample
    from rlstream.consumer.train.model import read_hf_dims

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
    from rlstream.common.config import ConsumerSettings

    _, parallel, replay = LAYOUTS[layout]
    if one_rank:
        return ConsumerSettings(replay=replay, **CFG)
    return ConsumerSettings(replay=replay, parallel=parallel,
                            memory={"micro_batch_tokens": MICRO_BATCH_TOKENS}, **CFG)


def run(model_dir: str, layout: str):
    from rlstream.consumer.train.model import forward_logits
    from rlstream.consumer.train.trainer import Trainer

    trainer = Trainer.from_hf(model_dir, trainer_config(layout))
    gb = trainer.build_batch(make_samples(model_dir), group_size=4)
    metrics = trainer.train_step(gb)
    metrics["micro_batches"] = min(len(mb.micro_batches()) for mb in gb.minibatches)
    # under TP each rank holds only its vocabulary shard of the logits
    metrics["logit_columns"] = forward_logits(trainer.model, torch.tensor([[5, 6, 7]])).shape[-1]
    if LAYOUTS[layout][1].get("tensor", 1) > 1:
        metrics.update(chunked_vs_full(model_dir, layout))
    if trainer.optimizer_state_sharded:
        metrics["restore_exact"] = restore_is_exact(model_dir, layout, trainer)
        metrics["legacy_restore_exact"] = restore_is_exact(model_dir, layout, trainer, gathered=True)
    return trainer.export_hf_state_dict(), metrics


def chunked_vs_full(model_dir: str, layout: str) -> dict:
    """Under TP: chunked log-probs (5 positions a chunk) against the unchunked
    vocabulary-parallel ones: max |diff| of values and entropy, relative gradient diff."""
    from rlstream.consumer.train.model import load_hf_checkpoint, per_token_logprobs
    from rlstream.consumer.train.parallel import ParallelLayout

    layout_ = ParallelLayout.of(trainer_config(layout).parallel, world_size(layout))
    model = load_hf_checkpoint(model_dir, layout_)
    tokens = torch.randint(3, model.hf_dims.vocab_size, (3, 40),  # 39 positions: padded
                           generator=torch.Generator().manual_seed(0))
    out = {}
    for chunk in (0, 5):
        model.zero_grad(set_to_none=True)
        lp = per_token_logprobs(model, tokens, chunk_tokens=chunk)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        with torch.no_grad():
            ent = per_token_logprobs(model, tokens, with_entropy=True, chunk_tokens=chunk)[1]
        out[chunk] = (lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp0, e0, g0), (lp1, e1, g1) = out[0], out[5]
    num = sum(float((g1[k] - g0[k]).pow(2).sum()) for k in g0)
    den = sum(float(g0[k].pow(2).sum()) for k in g0)
    return {"chunked_lp_diff": float((lp1 - lp0).abs().max()),
            "chunked_entropy_diff": float((e1 - e0).abs().max()),
            "chunked_grad_rel": (num / den) ** 0.5}


def restore_is_exact(model_dir: str, layout: str, trainer, gathered: bool = False) -> float:
    """Collective: every rank's trainer state through torch.save/load into a fresh
    trainer; 1.0 when, on every rank, the state read back equals the state saved
    (the masters and moments each rank holds a shard of: its own, saved and loaded
    by itself). `gathered`: the form checkpoints had before per-rank files, every
    rank's shard gathered to data-parallel rank 0 and scattered back on load."""
    import io

    import torch.distributed as dist

    from rlstream.consumer.train.trainer import Trainer

    buf = io.BytesIO()
    saved = trainer.state_dict()
    if gathered:  # what consumer/train/optimizer.py's state_dict() wrote then
        for opt, part in zip(trainer.optimizer.parts, saved["optimizer"]["parts"]):
            if "param_state" in part:
                part["param_state"] = opt.get_parameter_state_dp_zero()
                part["param_state_sharding_type"] = "dp_zero_gather_scatter"
    torch.save(saved, buf)
    buf.seek(0)
    fresh = Trainer.from_hf(model_dir, trainer_config(layout))
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    want, got = tensors_of(trainer.state_dict()), tensors_of(fresh.state_dict())
    same = set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    flag = torch.tensor([1.0 if same else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return float(flag)


def audit(model_dir: str, layout: str) -> dict:
    """The step with every collective recorded under a meta default device, the
    checkpoint's state (`checkpoint_calls`: it gathers nothing, each rank saves its
    own shard), and the old metric reduction as a negative control."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlstream.consumer.train.trainer import Trainer
    from tests.support.collectives import MetaCollective, misplaced, recorded

    trainer = Trainer.from_hf(model_dir, trainer_config(layout))
    gb = trainer.build_batch(make_samples(model_dir), group_size=4)
    with recorded() as calls, torch.device("meta"):
        trainer.train_step(gb)
    with recorded() as checkpoint_calls, torch.device("meta"):
        trainer.state_dict()
    with recorded() as old, torch.device("meta"):
        try:  # the trainer's metric reduction before issue #14
            dist.all_reduce(torch.tensor([1.0, 2.0], dtype=torch.float64),
                            group=ps.get_data_parallel_group())
        except MetaCollective:
            pass
    names = sorted({c.name for c in calls})
    return {"calls": len(calls), "names": names, "device": str(trainer.device),
            "checkpoint_calls": [c.name for c in checkpoint_calls],
            "misplaced": [(c.name, sorted(c.devices)) for c in misplaced(calls, trainer.device)],
            "old_misplaced": len(misplaced(old, trainer.device))}


def main(model_dir: str, out_dir: str, layouts: list[str]) -> None:
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    for layout in layouts or [k for k in LAYOUTS if world_size(k) == world]:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if layout.startswith("audit-"):
            result = audit(model_dir, layout.removeprefix("audit-"))
        else:
            sd, metrics = run(model_dir, layout)
            result = {"state": sd, "metrics": metrics}
        if dist.get_rank() == 0:
            torch.save(result, Path(out_dir) / f"{layout}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
