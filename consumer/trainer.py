"""The training step: old-policy forward, then N mini-batch updates.

    trainer = Trainer.from_hf(hf_dir, cfg.consumer)    # common.config.ConsumerSettings
    gb = trainer.build_batch(samples, group_size=16)
    metrics = trainer.train_step(gb)
    tensors = trainer.export_hf_state_dict()   # -> safetensors save_file

One step (docs/algorithm.md):
1. old_policy_pass: for each mini-batch, a no-grad forward gives log pi_old
   (R2 records the routing, R3 replays the rollout's), the training-inference
   KL, entropy and the rollout-vs-trainer routing agreement.
2. update, N times: forward (replaying per mode), loss, backward, gradient
   all-reduce over data-parallel ranks (sum; the loss is already normalised by
   global counts), clip, optimizer step (consumer/parallel.py).
3. step_metrics: one all-reduce of the metric sums, then means.

Metrics returned (means over response tokens of the whole global batch):
  kl_train_inference  E[log mu_old - log pi_old] (old-policy forward)
  entropy             token entropy of pi_old
  is_weight_mean/max, is_truncated_frac, clip_frac, ratio_mean (over updates)
  routing_agreement_layer_{l}  |rollout top-k & trainer top-k| / K (when routed)
  grad_norm (mean pre-clip norm over updates), grad_norm_max, loss (mean),
  num_responses, num_tokens, time_* (seconds: forward, backward, optimizer,
  total) and step_overhead_share = 1 - (forward+backward+optimizer)/total.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from common.config import ConsumerSettings, OptimizerSettings
from common.errors import CheckpointError, InvalidSampleError
from consumer import convert
from consumer.batch import GlobalBatch, MiniBatch, TrainSample, build_global_batch
from consumer.losses import LossInputs, advantage_mode, get_loss_fn
from consumer.model import load_hf_checkpoint, per_token_logprobs
from consumer.parallel import (ParallelLayout, allreduce_grads, clip_grad_norm, dp_size,
                               launch_world_size, world)
from consumer.replay import RoutingReplay, routing_agreement

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD_ID = 0
"""Token id of padding positions (masked out everywhere, so any valid id works)."""
TRAINING_KEYS = {"loss", "optimizer", "replay", "num_minibatches", "dtype", "parallel"}
"""The settings a checkpoint records (for the reader; secrets and paths stay out)."""


def build_optimizer(model, cfg: OptimizerSettings) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=True)


# ---------------------------------------------------------------- metrics


@dataclass
class OldPolicy:
    """Result of the old-policy forward of one mini-batch."""

    logprobs: torch.Tensor          # [B, S] log pi_old
    trainer_routing: torch.Tensor   # [B, S, L, K] the trainer routers' own top-k


class MetricSums:
    """Sums and maxima collected during a step, reduced over ranks in one go."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = defaultdict(lambda: float("-inf"))

    def add(self, key: str, value: float) -> None:
        self.sums[key] += float(value)

    def max(self, key: str, value: float) -> None:
        self.maxes[key] = max(self.maxes[key], float(value))

    def reduce(self) -> None:
        """Over data-parallel ranks: tensor-parallel ranks hold the same values."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if world() == 1:
            return
        for store, op in ((self.sums, dist.ReduceOp.SUM), (self.maxes, dist.ReduceOp.MAX)):
            keys = sorted(store)
            t = torch.tensor([store[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(t, op=op, group=ps.get_data_parallel_group())
            store.update(zip(keys, t.tolist()))


class Timers:
    def __init__(self):
        self.t: dict[str, float] = defaultdict(float)

    def time(self, key: str):
        timers = self

        class _Ctx:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timers.t[key] += time.perf_counter() - self.start
        return _Ctx()


# ---------------------------------------------------------------- trainer


class Trainer:
    """Owns the Megatron model, optimizer and routing replay for one rank."""

    def __init__(self, model, cfg: ConsumerSettings):
        self.model, self.cfg = model, cfg
        self.loss_fn = get_loss_fn(cfg.loss.name)
        self.advantage_mode = advantage_mode(cfg.loss)
        self.replay = RoutingReplay(model, cfg.replay)
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.step = 0

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, cfg: ConsumerSettings | None = None,
                world_size: int | None = None) -> "Trainer":
        """The model at `hf_dir` in the layout `cfg.parallel` gives a world of
        `world_size` processes (default: the launcher's, 1 alone)."""
        cfg = cfg or ConsumerSettings()
        layout = ParallelLayout.of(cfg.parallel, world_size or launch_world_size())
        return cls(load_hf_checkpoint(hf_dir, layout, DTYPES[cfg.dtype]), cfg)

    # -- data

    def build_batch(self, samples: list[TrainSample], group_size: int) -> GlobalBatch:
        """This rank's share of the global batch (see consumer/batch.py)."""
        from megatron.core import parallel_state as ps

        return build_global_batch(
            samples, group_size, self.cfg.num_minibatches, self.advantage_mode,
            pad_id=PAD_ID, dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size())

    # -- the step

    def train_step(self, gb: GlobalBatch) -> dict[str, float]:
        """Old-policy forward, then one update per mini-batch; returns metrics."""
        if len(gb.minibatches) != self.cfg.num_minibatches:
            raise InvalidSampleError(f"batch has {len(gb.minibatches)} mini-batches, "
                                     f"consumer.num_minibatches is {self.cfg.num_minibatches}: "
                                     "build it with this trainer's build_batch")
        timers, sums = Timers(), MetricSums()
        with timers.time("total"):
            self.model.train()
            self.replay.start_step()
            old = [self._old_policy(i, mb, timers, sums) for i, mb in enumerate(gb.minibatches)]
            for i, mb in enumerate(gb.minibatches):
                self._update(i, mb, old[i], timers, sums)
            sums.reduce()
        self.step += 1
        return self._step_metrics(sums, timers, gb)

    def _forward(self, mb: MiniBatch, timers: Timers, entropy: bool = False):
        """Model forward + log-softmax at the targets: log pi [B, S] (and entropy)."""
        with timers.time("forward"):
            return per_token_logprobs(self.model, mb.tokens, with_entropy=entropy)

    def _old_policy(self, i: int, mb: MiniBatch, timers: Timers, sums: MetricSums) -> OldPolicy:
        with torch.no_grad():
            (lp, ent), own = self.replay.old_policy(
                i, mb, lambda: self._forward(mb, timers, entropy=True))
        mask = mb.loss_mask
        sums.add("old_tokens", mask.sum())
        sums.add("kl_sum", ((mb.rollout_logprobs - lp.cpu()) * mask).sum())
        sums.add("entropy_sum", (ent.cpu() * mask).sum())
        if mb.routing is not None:
            routed = mask & mb.routing_mask
            sums.add("routed_tokens", routed.sum())
            for layer, agree in enumerate(routing_agreement(mb.routing.long(), own.cpu(), routed)):
                sums.add(f"agree_sum_{layer}", agree * float(routed.sum()))
        return OldPolicy(logprobs=lp.detach(), trainer_routing=own)

    def _update(self, i: int, mb: MiniBatch, old: OldPolicy, timers: Timers,
                sums: MetricSums) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        lp = self.replay.update(i, mb, lambda: self._forward(mb, timers))
        dev = lp.device
        inp = LossInputs(
            logprobs=lp, old_logprobs=old.logprobs, rollout_logprobs=mb.rollout_logprobs.to(dev),
            mask=mb.loss_mask.to(dev), advantages=mb.advantages.to(dev),
            sample_weight=mb.sample_weight.to(dev), num_responses=mb.num_responses,
            num_tokens=mb.num_tokens)
        loss, m = self.loss_fn(inp, self.cfg.loss)
        with timers.time("backward"):
            loss.backward()
        with timers.time("optimizer"):
            allreduce_grads(self.named_params)
            norm = clip_grad_norm(self.named_params, self.cfg.optimizer.grad_clip)
            self.optimizer.step()
        self._collect_update_metrics(sums, m, float(loss.detach()), norm)

    @staticmethod
    def _collect_update_metrics(sums: MetricSums, m: dict, loss: float, norm: float) -> None:
        n = m["tokens"]
        sums.add("upd_tokens", n)
        for key in ("is_weight_mean", "is_truncated_frac", "clip_frac", "ratio_mean"):
            sums.add(key, m[key] * n)
        sums.max("is_weight_max", m["is_weight_max"])
        sums.add("loss", loss)  # already normalised by global counts: sum over ranks
        sums.add("grad_norm_rank_sum", norm)
        sums.max("grad_norm_max", norm)
        sums.add("updates", 1)

    def _step_metrics(self, sums: MetricSums, timers: Timers, gb: GlobalBatch) -> dict:
        s, mx, world = sums.sums, sums.maxes, dp_size()
        ut, ot = max(s["upd_tokens"], 1), max(s["old_tokens"], 1)
        updates = s["updates"] / world
        out = {key: s[key] / ut for key in ("is_weight_mean", "is_truncated_frac",
                                            "clip_frac", "ratio_mean")}
        out.update(
            kl_train_inference=s["kl_sum"] / ot, entropy=s["entropy_sum"] / ot,
            is_weight_max=mx["is_weight_max"], loss=s["loss"] / updates,
            grad_norm=s["grad_norm_rank_sum"] / world / updates,
            grad_norm_max=mx["grad_norm_max"], num_responses=gb.num_responses,
            num_tokens=gb.num_tokens, step=self.step)
        if s.get("routed_tokens"):
            n_layers = sum(1 for k in s if k.startswith("agree_sum_"))
            for layer in range(n_layers):
                out[f"routing_agreement_layer_{layer}"] = (
                    s[f"agree_sum_{layer}"] / s["routed_tokens"])
        t = timers.t
        compute = t["forward"] + t["backward"] + t["optimizer"]
        out.update({f"time_{k}": v for k, v in t.items()})
        out["step_overhead_share"] = max(0.0, 1.0 - compute / max(t["total"], 1e-9))
        return out

    # -- weights and checkpoints

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """On-disk HF tensors for vLLM (collective when tp/ep > 1; the whole dict on rank 0)."""
        return convert.export_hf_state_dict(self.model)

    def weight_source(self):
        """The current weights as a vLLM WeightSource, HF names per layer group, gathered to
        rank 0 (consumer/weight_source.py; iterate on every rank when tp/ep > 1)."""
        from consumer.weight_source import MegatronSource

        return MegatronSource(self.model)

    def state_dict(self) -> dict:
        """Model + optimizer + step of this rank. Loadable with
        `torch.load(weights_only=True)`; model tensors are live references, so
        serialise it right away."""
        return {"model": convert.local_megatron_state_dict(self.model),
                "optimizer": self.optimizer.state_dict(), "step": self.step,
                "config": self.cfg.model_dump(include=TRAINING_KEYS)}

    def load_state_dict(self, state: dict) -> None:
        own = convert.local_megatron_state_dict(self.model)
        if set(own) != set(state["model"]):
            raise CheckpointError("the checkpoint's tensors do not match this model and parallel "
                                  "layout (consumer.parallel): resume with the layout that wrote it")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state["model"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
