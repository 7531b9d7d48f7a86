"""The training step: old-policy forward, then N mini-batch updates.

    trainer = Trainer.from_hf(hf_dir, TrainerConfig(loss="minirl", replay="R3"))
    gb = trainer.build_batch(samples, group_size=16)
    metrics = trainer.train_step(gb)
    tensors = trainer.export_hf_state_dict()   # -> safetensors save_file

One step (docs/algorithm.md):
1. old_policy_pass: for each mini-batch, a no-grad forward gives log pi_old
   (R2 records the routing, R3 replays the rollout's), the training-inference
   KL, entropy and the rollout-vs-trainer routing agreement.
2. update, N times: forward (replaying per mode), loss, backward, gradient
   all-reduce over data-parallel ranks (sum; the loss is already normalised by
   global counts), clip, optimizer step.
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
from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.errors import ConfigError
from consumer import convert
from consumer.batch import ADVANTAGE_MODES, GlobalBatch, MiniBatch, TrainSample, build_global_batch
from consumer.losses import ADVANTAGE_MODE, LOSSES, LossConfig, LossInputs, get_loss_fn
from consumer.model import ParallelConfig, load_hf_checkpoint, per_token_logprobs
from consumer.replay import ReplayMode, RoutingReplay, routing_agreement

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainerConfig(BaseModel):
    """Trainer settings (the consumer service embeds this in its config)."""

    model_config = ConfigDict(extra="forbid")

    loss: str = Field("minirl", description=f"one of {sorted(LOSSES)}")
    eps_low: float = Field(0.2, ge=0, lt=1, description="mask/clip below 1 - eps_low")
    eps_high: float = Field(0.27, ge=0, description="mask/clip above 1 + eps_high")
    is_cap: float = Field(5.0, gt=0, description="truncation C of the IS weight pi/mu_old")
    advantage: str = Field("auto", description="auto (per loss), mean or mean_std")
    replay: str = Field("none", description="routing replay: none, R2 or R3")
    optimizer: str = Field("adamw", description="adamw or sgd")
    lr: float = Field(1e-6, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    num_minibatches: int = Field(1, ge=1, description="N updates per global batch")
    dtype: str = Field("float32", description="float32 or bfloat16 (params and compute)")
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    ep: int = Field(1, ge=1, description="expert-parallel size (divides dp)")
    dp: int = Field(1, ge=1, description="data-parallel size; tp * dp = world size")
    pad_id: int = Field(0, ge=0, description="token id used for padding")

    @field_validator("loss")
    @classmethod
    def _loss(cls, v):
        get_loss_fn(v)
        return v

    @field_validator("replay")
    @classmethod
    def _replay(cls, v):
        return ReplayMode.parse(v).value

    @field_validator("advantage")
    @classmethod
    def _adv(cls, v):
        if v != "auto" and v not in ADVANTAGE_MODES:
            raise ValueError(f"advantage must be auto or one of {ADVANTAGE_MODES}")
        return v

    @field_validator("optimizer")
    @classmethod
    def _opt(cls, v):
        if v not in ("adamw", "sgd"):
            raise ValueError("optimizer must be adamw or sgd")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        if v not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        return v

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, ep=self.ep, dp=self.dp)

    @property
    def advantage_mode(self) -> str:
        return ADVANTAGE_MODE[self.loss] if self.advantage == "auto" else self.advantage


def build_optimizer(model, cfg: TrainerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, foreach=True)


# ---------------------------------------------------------------- distributed helpers


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _dp_size() -> int:
    """Ranks holding different data (tensor-parallel ranks share theirs)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if _world() > 1 else 1


def _allreduce(grads: list[torch.Tensor], group) -> None:
    import torch.distributed as dist

    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def allreduce_grads(named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Sum gradients over data-parallel ranks (experts: expert-data-parallel).

    Under tensor (and so sequence) parallelism, first sum over the TP group the
    gradients of the weights every TP rank holds whole (norms, q/k norms,
    router): each rank saw only its slice of the sequence or its heads, so
    each holds a partial sum.
    """
    from megatron.core import parallel_state as ps

    if _world() == 1:
        return
    _allreduce([p.grad for _, p in named_params if p.grad is not None
                and not getattr(p, "tensor_model_parallel", False)],
               ps.get_tensor_model_parallel_group())
    for expert, group in ((False, ps.get_data_parallel_group()),
                          (True, ps.get_expert_data_parallel_group())):
        _allreduce([p.grad for n, p in named_params if _is_expert(n) == expert
                    and p.grad is not None], group)


def clip_grad_norm(named_params, max_norm: float) -> float:
    """Global grad norm across tensor/expert-parallel shards; clip if max_norm > 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    sq = torch.zeros(2, dtype=torch.float64)  # [dense, expert]
    for name, p in named_params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            sq[int(_is_expert(name))] += p.grad.detach().double().pow(2).sum().cpu()
    if _world() > 1:
        d, e = sq[0:1].clone(), sq[1:2].clone()
        dist.all_reduce(d, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(e, group=ps.get_expert_tensor_and_model_parallel_group())
        sq = torch.cat([d, e])
    norm = float(sq.sum().sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for _, p in named_params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


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

        if _world() == 1:
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

    def __init__(self, model, cfg: TrainerConfig):
        self.model, self.cfg = model, cfg
        self.loss_fn = get_loss_fn(cfg.loss)
        self.loss_cfg = LossConfig(eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                   is_cap=cfg.is_cap)
        self.replay = RoutingReplay(model, cfg.replay)
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg)
        self.step = 0

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, cfg: TrainerConfig | None = None) -> "Trainer":
        cfg = cfg or TrainerConfig()
        model = load_hf_checkpoint(hf_dir, cfg.parallel, DTYPES[cfg.dtype])
        return cls(model, cfg)

    # -- data

    def build_batch(self, samples: list[TrainSample], group_size: int) -> GlobalBatch:
        """This rank's share of the global batch (see consumer/batch.py)."""
        from megatron.core import parallel_state as ps

        return build_global_batch(
            samples, group_size, self.cfg.num_minibatches, self.cfg.advantage_mode,
            pad_id=self.cfg.pad_id, dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size())

    # -- the step

    def train_step(self, gb: GlobalBatch) -> dict[str, float]:
        """Old-policy forward, then one update per mini-batch; returns metrics."""
        if len(gb.minibatches) != self.cfg.num_minibatches:
            raise ConfigError(f"batch has {len(gb.minibatches)} mini-batches, config says "
                              f"{self.cfg.num_minibatches}", "trainer.num_minibatches")
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
        loss, m = self.loss_fn(inp, self.loss_cfg)
        with timers.time("backward"):
            loss.backward()
        with timers.time("optimizer"):
            allreduce_grads(self.named_params)
            norm = clip_grad_norm(self.named_params, self.cfg.grad_clip)
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
        s, mx, world = sums.sums, sums.maxes, _dp_size()
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
        """On-disk HF tensors for vLLM (collective when tp/ep > 1)."""
        return convert.export_hf_state_dict(self.model)

    def checkpoint_shard(self) -> tuple[str, bool, list[str]]:
        """(this rank's shard name, whether this rank writes it, every shard name).
        One rank per (tp rank, ep rank) pair writes: the first of its
        expert-data-parallel group (data-parallel copies are identical)."""
        from megatron.core import parallel_state as ps

        from consumer.checkpoint import all_shard_names, shard_name

        tp_rank, tp, ep_rank, ep = convert._ranks()
        writes = _world() == 1 or ps.get_expert_data_parallel_rank() == 0
        return shard_name(tp_rank, tp, ep_rank, ep), writes, all_shard_names(tp, ep)

    def state_dict(self) -> dict:
        """Model + optimizer + step of this rank. Loadable with
        `torch.load(weights_only=True)`; model tensors are live references, so
        serialise it right away."""
        return {"model": convert.local_megatron_state_dict(self.model),
                "optimizer": self.optimizer.state_dict(), "step": self.step,
                "config": self.cfg.model_dump()}

    def load_state_dict(self, state: dict) -> None:
        own = convert.local_megatron_state_dict(self.model)
        if set(own) != set(state["model"]):
            raise ConfigError("checkpoint does not match this model/parallel layout",
                              "checkpoint")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state["model"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
