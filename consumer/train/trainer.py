"""The training step: old-policy forward, then N mini-batch updates.

    trainer = Trainer.from_hf(hf_dir, cfg.consumer)    # rlstream.common.config.ConsumerSettings
    gb = trainer.build_batch(samples, group_size=16)
    metrics = trainer.train_step(gb)
    tensors = trainer.export_hf_state_dict()   # -> safetensors save_file

One step (docs/algorithm.md), each mini-batch cut into micro-batches by the token
budget `consumer.memory.micro_batch_tokens` (consumer/train/batch.py):
1. old_policy_pass: micro-batch by micro-batch, a no-grad forward gives
   log pi_old (R2 records the routing, R3 replays the rollout's), the training-
   inference KL, entropy and the rollout-vs-trainer routing agreement.
2. update, N times: per micro-batch forward (replaying per mode), loss and
   backward, the gradients accumulating; then the optimizer
   (consumer/train/optimizer.py): gradient sum over the ranks (the loss is normalised
   by global counts, so the micro-batches' sum is the mini-batch's), clip, and a
   step on fp32 master weights.
3. step_metrics: the metric sums live on the model's device; one all-reduce of
   the sums and one of the maxima (consumer/train/parallel.py), then means.

Metrics returned (means over response tokens of the whole global batch):
  kl_train_inference  E[log mu_old - log pi_old] (old-policy forward)
  entropy             token entropy of pi_old
  is_weight_mean/max, is_truncated_frac, clip_frac, ratio_mean (over updates)
  routing_agreement_layer_{l}  |rollout top-k & trainer top-k| / K (when routed)
  ess, mismatch_kl, by_staleness  stability signals (consumer/stability/signals.py)
  grad_norm (mean pre-clip norm over updates), grad_norm_max, loss (mean),
  num_responses, num_tokens, time_* (seconds: forward, backward, optimizer,
  total) and step_overhead_share = 1 - (forward+backward+optimizer)/total.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict

import torch

from rlstream.common.config import ConsumerSettings
from rlstream.common.errors import CheckpointError, InvalidSampleError
from rlstream.consumer.train import export, layout
from rlstream.consumer.train.batch import (
    BatchShare,
    GlobalBatch,
    MiniBatch,
    TrainSample,
    batch_from_share,
    build_global_batch,
    split_global_batch,
)
from rlstream.consumer.train.losses import LossInputs, advantage_mode, get_loss_fn
from rlstream.consumer.train.model import load_hf_checkpoint, per_token_logprobs
from rlstream.consumer.train.optimizer import TrainerOptimizer
from rlstream.consumer.train.parallel import (
    ParallelLayout,
    dp_size,
    launch_world_size,
    reduce_over_data_parallel,
)
from rlstream.consumer.train.replay import RoutingReplay, agreement_sums
from rlstream.consumer.stability import signals

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD_ID = 0
"""Token id of padding positions (masked out everywhere, so any valid id works)."""
TRAINING_KEYS = {"loss", "optimizer", "replay", "num_minibatches", "dtype", "parallel"}
"""The settings a checkpoint records (for the reader; secrets and paths stay out)."""


# ---------------------------------------------------------------- metrics


class MetricSums:
    """Sums and maxima collected during a step. They stay tensors on the model's
    device (no host synchronisation per value) until `reduce`, which all-reduces
    them over the data-parallel ranks in one message per kind."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    def _on_device(self, value) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.detach().to(self.device, torch.float64)
        return torch.tensor(value, dtype=torch.float64, device=self.device)

    def add(self, key: str, value) -> None:
        v = self._on_device(value)
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def max(self, key: str, value) -> None:
        v = self._on_device(value)
        self.maxes[key] = torch.maximum(self.maxes[key], v) if key in self.maxes else v

    def reduce(self) -> tuple[dict, dict]:
        """(sums, maxima) over data-parallel ranks as host floats (lists for vectors).
        Tensor-parallel ranks hold the same values, so they are not reduced over."""
        return self._reduced(self.sums, "sum"), self._reduced(self.maxes, "max")

    def _reduced(self, store: dict[str, torch.Tensor], op: str) -> dict:
        keys = sorted(store)
        if not keys:
            return {}
        flat = reduce_over_data_parallel(torch.cat([store[k].reshape(-1) for k in keys]), op)
        values, out, at = flat.tolist(), {}, 0
        for k in keys:
            n = store[k].numel()
            out[k] = values[at] if store[k].dim() == 0 else values[at:at + n]
            at += n
        return out


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
        self.device = next(model.parameters()).device
        self.loss_fn = get_loss_fn(cfg.loss.name)
        self.advantage_mode = advantage_mode(cfg.loss)
        self.replay = RoutingReplay(model, cfg.replay)
        self.optimizer = TrainerOptimizer(model, cfg.optimizer)
        self.step = 0

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, cfg: ConsumerSettings | None = None,
                world_size: int | None = None) -> "Trainer":
        """The model at `hf_dir` in the layout `cfg.parallel` gives a world of
        `world_size` processes (default: the launcher's, 1 alone)."""
        cfg = cfg or ConsumerSettings()
        parallel = ParallelLayout.of(cfg.parallel, world_size or launch_world_size())
        model = load_hf_checkpoint(hf_dir, parallel, DTYPES[cfg.dtype], cfg.memory.attention,
                                   cfg.memory.recompute, cfg.memory.experts)
        return cls(model, cfg)

    # -- data

    def build_batch(self, samples: list[TrainSample], group_size: int) -> GlobalBatch:
        """This rank's share of the global batch, micro-batches planned (consumer/train/batch.py)."""
        from megatron.core import parallel_state as ps

        return build_global_batch(
            samples, group_size, self.cfg.num_minibatches, self.advantage_mode,
            pad_id=PAD_ID, dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            micro_batch_tokens=self.cfg.memory.micro_batch_tokens)

    def split_batch(self, samples: list[TrainSample], group_size: int) -> list[BatchShare]:
        """The global batch cut into one share per data-parallel rank (rank 0's part
        of `build_batch`; consumer/ranks/protocol.py sends each rank its own)."""
        return split_global_batch(samples, group_size, self.cfg.num_minibatches, self.advantage_mode,
                                  dp_size())

    def batch_from_share(self, share: BatchShare) -> GlobalBatch:
        """This rank's mini-batches from its share (the other part of `build_batch`)."""
        return batch_from_share(share, PAD_ID, self.cfg.memory.micro_batch_tokens)

    # -- the step

    def train_step(self, gb: GlobalBatch) -> dict[str, float]:
        """Old-policy forward, then one update per mini-batch; returns metrics."""
        if len(gb.minibatches) != self.cfg.num_minibatches:
            raise InvalidSampleError(f"batch has {len(gb.minibatches)} mini-batches, "
                                     f"consumer.num_minibatches is {self.cfg.num_minibatches}: "
                                     "build it with this trainer's build_batch")
        timers, sums = Timers(), MetricSums(self.device)
        with timers.time("total"):
            self.model.train()
            self.replay.start_step()
            old = [self._old_policy(i, mb, timers, sums) for i, mb in enumerate(gb.minibatches)]
            for i, mb in enumerate(gb.minibatches):
                self._update(i, mb, old[i], timers, sums)
            reduced = sums.reduce()
        self.step += 1
        return self._step_metrics(*reduced, timers, gb)

    def _forward(self, mb: MiniBatch, timers: Timers, entropy: bool = False):
        """Model forward + log-softmax at the targets: log pi [B, S] (and entropy)."""
        with timers.time("forward"):
            return per_token_logprobs(self.model, mb.tokens, with_entropy=entropy,
                                      temperature=mb.temperature,
                                      chunk_tokens=self.cfg.memory.logprob_chunk_tokens)

    def _old_policy(self, i: int, mb: MiniBatch, timers: Timers,
                    sums: MetricSums) -> list[torch.Tensor]:
        """log pi_old [b, s] of each micro-batch of mini-batch i (device), and its metrics."""
        return [self._old_policy_micro((i, j), micro, timers, sums)
                for j, micro in enumerate(mb.micro_batches())]

    @torch.no_grad()
    def _old_policy_micro(self, key, mb: MiniBatch, timers: Timers,
                          sums: MetricSums) -> torch.Tensor:
        (lp, ent), own = self.replay.old_policy(
            key, mb, lambda: self._forward(mb, timers, entropy=True))
        mask = mb.loss_mask.to(self.device)
        sums.add("old_tokens", mask.sum())
        sums.add("kl_sum", ((mb.rollout_logprobs.to(self.device) - lp) * mask).sum())
        signals.add_old_policy(sums, mask, mb.rollout_logprobs.to(self.device), lp, mb.staleness)
        sums.add("entropy_sum", (ent * mask).sum())
        # every data-parallel rank adds the same keys: the sums are all-reduced as one flat
        # tensor, and a rank whose share has no routing (a producer with routing off) added
        # fewer values: gloo aborted the trainer ("32 vs 24"), nccl would reduce garbage
        if mb.routing is not None:
            routed = mb.loss_mask & mb.routing_mask
            sums.add("routed_tokens", routed.sum())
            sums.add("agree_sum", agreement_sums(mb.routing, own, routed))
        else:
            sums.add("routed_tokens", 0)
            sums.add("agree_sum", torch.zeros(self.model.hf_dims.num_layers, dtype=torch.float64))
        return lp  # the trainer's own routing `own` is dropped here

    def _update(self, i: int, mb: MiniBatch, old: list[torch.Tensor], timers: Timers,
                sums: MetricSums) -> None:
        """One optimizer step on mini-batch i, its gradients summed over the micro-batches."""
        self.optimizer.zero_grad()
        micro = mb.micro_batches()
        for j, (part, old_lp) in enumerate(zip(micro, old)):
            with self.optimizer.accumulating(last=j == len(micro) - 1):
                self._accumulate((i, j), part, old_lp, timers, sums)
        with timers.time("optimizer"):
            norm = self.optimizer.step()
        sums.add("grad_norm_rank_sum", norm)
        sums.max("grad_norm_max", norm)
        sums.add("updates", 1)

    def _accumulate(self, key, mb: MiniBatch, old_lp: torch.Tensor, timers: Timers,
                    sums: MetricSums) -> None:
        """Forward, loss and backward of one micro-batch (replay kept through backward)."""
        dev = self.device
        with self.replay.update(key, mb) as backward:
            inp = LossInputs(
                logprobs=self._forward(mb, timers), old_logprobs=old_lp,
                rollout_logprobs=mb.rollout_logprobs.to(dev), mask=mb.loss_mask.to(dev),
                advantages=mb.advantages.to(dev), sample_weight=mb.sample_weight.to(dev),
                num_responses=mb.num_responses, num_tokens=mb.num_tokens)
            loss, m = self.loss_fn(inp, self.cfg.loss)
            with timers.time("backward"):
                backward(loss)
        signals.add_update(sums, inp.mask, inp.logprobs, inp.rollout_logprobs, m["clipped"], mb.staleness,
                           self.cfg.loss.is_cap)
        n = m["tokens"]
        sums.add("upd_tokens", n)
        for k in ("is_weight_mean", "is_truncated_frac", "clip_frac", "ratio_mean"):
            sums.add(k, m[k] * n)
        sums.max("is_weight_max", m["is_weight_max"])
        sums.add("loss", loss)  # normalised by global counts: summed over micro-batches, ranks

    def _step_metrics(self, s: dict, mx: dict, timers: Timers, gb: GlobalBatch) -> dict:
        world = dp_size()
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
        out.update(signals.step_signals(s))
        if s.get("routed_tokens"):
            for layer, agree in enumerate(s["agree_sum"]):
                out[f"routing_agreement_layer_{layer}"] = agree / s["routed_tokens"]
        t = timers.t
        compute = t["forward"] + t["backward"] + t["optimizer"]
        out.update({f"time_{k}": v for k, v in t.items()})
        out["step_overhead_share"] = max(0.0, 1.0 - compute / max(t["total"], 1e-9))
        return out

    # -- weights and checkpoints

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """On-disk HF tensors for vLLM (collective when tp/ep > 1; the whole dict on rank 0)."""
        return export.export_hf_state_dict(self.model)

    def weight_source(self):
        """The current weights as a vLLM WeightSource, HF names per layer group, gathered to
        rank 0 (consumer/train/export.py; iterate on every rank when tp/ep > 1)."""
        return export.MegatronSource(self.model)

    @property
    def optimizer_state_sharded(self) -> bool:
        """The optimizer state is spread over data-parallel ranks (distributed
        optimizer, dp > 1): each rank's `state_dict` holds its own shard of it."""
        return self.optimizer.distributed and dp_size() > 1

    def state_dict(self) -> dict:
        """Model + optimizer (fp32 masters and moments included) + step of this rank.
        Loadable with `torch.load(weights_only=True)`; model tensors are live
        references, so copy or serialise it right away. The distributed optimizer's
        masters and moments are this rank's own shard; nothing is gathered
        (consumer/train/optimizer.py)."""
        return {"model": layout.local_megatron_state_dict(self.model),
                "optimizer": self.optimizer.state_dict(), "step": self.step,
                "config": self.cfg.model_dump(include=TRAINING_KEYS), "experts": self.model.experts}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (collective for checkpoints of the older gathered form)."""
        saved = state.get("experts")  # absent before checkpoints named it
        if saved is not None and saved != self.model.experts:
            raise CheckpointError(
                f"consumer.memory.experts: the checkpoint was written with the {saved} experts kernel, this "
                f"trainer built {self.model.experts} ('auto' depends on the host: Transformer Engine, CUDA). "
                f"Their weights and optimizer buckets are laid out differently; resume where the setting "
                f"gives {saved} (sequential, or grouped where that is {saved})")
        own = layout.local_megatron_state_dict(self.model)
        if set(own) != set(state["model"]):
            raise CheckpointError("the checkpoint's tensors do not match this model and parallel "
                                  "layout (consumer.parallel): resume with the layout that wrote it")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state["model"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
