"""The trainer's optimizer: Megatron's DistributedDataParallel and mixed-precision optimizer.

    opt = TrainerOptimizer(model, cfg.optimizer)   # rlstream.common.config.OptimizerSettings
    opt.zero_grad()
    for j, micro in enumerate(micro_batches):
        with opt.accumulating(last=j == len(micro_batches) - 1):
            loss_of(micro).backward()              # gradients add up in fp32 buffers
    grad_norm = opt.step()                         # reduce, clip, step: the pre-clip global norm
    state = opt.state_dict(); opt.load_state_dict(state)   # collective (distributed optimizer)

Precision. Parameters and compute are in the model's dtype. Gradients accumulate
and are reduced in fp32 (`grad_reduce_in_fp32`). With bf16 parameters the
optimizer keeps fp32 master weights and fp32 Adam moments and writes
`master.bf16()` into the parameters after each step (Megatron's
Float16OptimizerWithFloat16Params, or its DistributedOptimizer with
`optimizer.distributed`, which shards masters and moments over the data-parallel
ranks). Plain AdamW on bf16 parameters loses every update below the bf16 spacing
(at lr 1e-6 ~98 % of the weights never move): docs/trainer-scale.md has the
measurement (bf16_update_rel_error).

Reduction. The losses are normalised by global counts (consumer/train/losses.py), so
gradients are SUMMED over data-parallel ranks: `calculate_per_token_loss=True`
sets DDP's gradient scaling to 1 (`average_in_collective` stays False).
`finalize_model_grads` sums dense gradients over the data-parallel group, expert
gradients over the expert-data-parallel group, and the partial gradients of the
weights every TP rank holds whole (sequence-parallel norms, routers, q/k norms)
over the TP group. The step takes the global norm over every shard (TP duplicates
once), clips and updates. All of it runs on the gradient buffers' device.

sgd is Megatron's SGD with momentum 0 and never distributed (Megatron's
DistributedOptimizer shards Adam state only). `overlap_param_gather` stays off:
with it parameters are gathered by the next forward, and weights exported right
after a step would be one update stale.

Checkpoints. The distributed optimizer's own `state_dict()` holds no tensors; here
`state_dict()` adds each sharded optimizer's masters and moments of THIS rank only
(Megatron's "dp_reshardable" bucket-space form, `get_parameter_state_dp_reshardable`:
live references, no gather, no collective), and `load_state_dict()` puts them back
into this rank's shard. `split_rank_state` separates that per-rank part from the rest
(what every rank of a (tp, ep) pair holds alike) so that each rank writes its own
file (consumer/ranks/protocol.py). The earlier form gathered every data-parallel rank's
masters and moments to data-parallel rank 0 ("dp_zero_gather_scatter", a collective
over gloo): that gather blocked the step (4.55 s of a 4.79 s checkpoint,
docs/trainer-scale.md) and landed every expert shard's state on node 0.
Checkpoints written in it still load (collective then: every rank loads its
pair's file and rank 0's state is scattered).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import torch

from rlstream.common import gpu_standin
from rlstream.common.config import OptimizerSettings
from rlstream.common.errors import CheckpointError, ConfigError
from rlstream.consumer.train import megatron_shims

GATHERED = "dp_zero_gather_scatter"
"""Megatron's name for the gather-to-rank-0 form of the distributed optimizer's state
(checkpoints written before each rank saved its own shard)."""
PER_RANK = "dp_reshardable"
"""Megatron's name for one rank's own shard of that state, as its buckets hold it."""


class TrainerOptimizer:
    """Gradient buffers (Megatron DDP around `model`) and the optimizer of one rank."""

    def __init__(self, model, cfg: OptimizerSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import get_megatron_optimizer

        _check_offload_device(cfg)
        self.distributed = cfg.distributed and cfg.name == "adamw"
        model.config.calculate_per_token_loss = True  # sum over data-parallel ranks, no 1/dp
        self.ddp = DistributedDataParallel(
            config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
                use_distributed_optimizer=self.distributed, average_in_collective=False,
                check_for_nan_in_grad=False, bucket_size=None))
        with megatron_shims.cuda_as_cpu():
            opt = get_megatron_optimizer(_megatron_config(cfg, model.config, self.distributed),
                                         [self.ddp])
        self.optimizer = megatron_shims.wrap_optimizer(opt)

    @property
    def parts(self) -> list:
        """The optimizers Megatron chains: dense, then experts when expert-parallel."""
        return list(self.optimizer.chained_optimizers)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def accumulating(self, last: bool):
        """Around one micro-batch's backward: no gradient synchronisation until the last."""
        return nullcontext() if last else self.ddp.no_sync()

    def step(self) -> float:
        """Reduce the gradients, clip (`grad_clip` > 0) and step; the pre-clip global norm."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        _ok, grad_norm, _ = self.optimizer.step()  # no loss scaler in bf16: never skipped
        return float(grad_norm)

    def fp32_masters(self) -> dict:
        """{model parameter: its fp32 master}: this rank's flat shard under the
        distributed optimizer, the whole tensor otherwise (fp32 parameters are their
        own masters). For inspection: tests and tests/bench/trainer_scale.py."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

        out = {}
        for opt in self.parts:
            if isinstance(opt, DistributedOptimizer):
                for p in opt.model_param_group_index_map:
                    out[p] = opt._get_main_param_and_optimizer_states(p)["param"]
            elif isinstance(opt, Float16OptimizerWithFloat16Params):
                for model, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    out.update(zip(model, masters))
                out.update((p, p) for group in opt.fp32_from_fp32_groups for p in group)
            else:
                out.update((p, p) for g in opt.optimizer.param_groups for p in g["params"])
        return out

    # -- checkpoints

    def state_dict(self) -> dict:
        """Every chained optimizer's state; a distributed optimizer's masters and moments
        are this rank's own shard, as live references (copy them before the next step).
        Not collective: nothing is gathered."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        parts = []
        for opt in self.parts:
            sd = opt.state_dict()
            if isinstance(opt, DistributedOptimizer):
                sd["param_state"] = opt.get_parameter_state_dp_reshardable()
                sd["param_state_sharding_type"] = PER_RANK
            parts.append(sd)
        return {"distributed": self.distributed, "parts": parts}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict`; also reads the gathered form of older checkpoints
        (collective then: call it on every rank). The model's parameters must be loaded."""
        if state.get("distributed") != self.distributed or len(state["parts"]) != len(self.parts):
            raise CheckpointError(
                f"the checkpoint's optimizer (distributed={state.get('distributed')}, "
                f"{len(state['parts'])} parts) does not match this one (distributed="
                f"{self.distributed}, {len(self.parts)} parts): resume with the "
                "consumer.optimizer and consumer.parallel that wrote it")
        with torch.no_grad():  # the sharded fp32 masters are views of leaf parameters
            for opt, sd in zip(self.parts, state["parts"]):
                sharding = sd.get("param_state_sharding_type")
                if sharding not in (GATHERED, PER_RANK):
                    opt.load_state_dict(sd)
                    continue
                if sd.get("param_state") is None and sharding == PER_RANK:
                    raise CheckpointError("the checkpoint holds no optimizer state of this rank "
                                          "(its per-rank file was not joined): a torn checkpoint?")
                opt.load_state_dict({k: v for k, v in sd.items() if not k.startswith("param_state")})
                load = _load_own_param_state if sharding == PER_RANK else _load_gathered_param_state
                _keeping_steps(opt, partial(load, opt), sd["param_state"])
                _resync_offload(opt)


def split_rank_state(state: dict) -> tuple[dict, list]:
    """`state` (a `state_dict()`) without its per-rank parameter state, and that state
    (one entry per chained optimizer, None where it has none): what only this rank
    holds, apart from what every rank of its (tp, ep) pair holds alike."""
    shared, own = [], []
    for sd in state["parts"]:
        mine = sd.get("param_state_sharding_type") == PER_RANK
        own.append(sd["param_state"] if mine else None)
        shared.append({k: v for k, v in sd.items() if k != "param_state"} if mine else sd)
    return {**state, "parts": shared}, own


def join_rank_state(state: dict, own: list) -> dict:
    """Inverse of `split_rank_state`."""
    if len(own) != len(state["parts"]):
        raise CheckpointError(f"the checkpoint's per-rank optimizer state has {len(own)} parts, its "
                              f"shared state {len(state['parts'])}: files of two checkpoints mixed?")
    parts = [sd if mine is None else {**sd, "param_state": mine} for sd, mine in zip(state["parts"], own)]
    return {**state, "parts": parts}


def _load_own_param_state(opt, param_state) -> None:
    """`load_parameter_state_from_dp_reshardable` of what `get_parameter_state_dp_reshardable`
    gave: Megatron's loader expects the `padding` flag its dist-checkpointing form adds."""
    for dtype_state in (v for k, v in param_state.items() if isinstance(k, int)):
        for buckets in dtype_state.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    opt.load_parameter_state_from_dp_reshardable(param_state)


def _load_gathered_param_state(opt, param_state) -> None:
    """Checkpoints from before per-rank files: data-parallel rank 0's gathered state,
    scattered to the ranks (collective)."""
    opt.load_parameter_state_from_dp_zero(param_state)


def _resync_offload(opt) -> None:
    """With the optimizer CPU offload (Megatron's HybridDeviceOptimizer), after a load:
    - the loaded state goes to each sub-optimizer and the fp32 copies they update take the
      checkpoint's masters (`_sync_hdo_state_to_sub_optimizers`: Megatron's dp_zero loader
      calls it, its dp_reshardable one does not, so the masters were rebuilt from the bf16
      weights and the GPU-resident parameters got the checkpoint's host tensors as moments);
    - every state tensor is moved to its parameter's device. HDO's own move tells its two
      optimizers apart by class, and without Transformer Engine or Apex both are torch's
      AdamW: it would put the GPU optimizer's state on the host too (a device mismatch at
      the first step after every resume);
    - the model's parameters are written back from the masters: loading ran HDO's
      `dummy_step` on random gradients after the weights were loaded, one Adam step off."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    hdo = opt.optimizer
    if not isinstance(hdo, HybridDeviceOptimizer):
        return
    hdo._sync_hdo_state_to_sub_optimizers()
    for sub in hdo.sub_optimizers:
        for param, state in sub.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = _on_device_of(v, param)
    for param, inner in hdo.param_to_inner_param.items():
        if inner is not param:
            param.data.copy_(inner.data)


def _on_device_of(v: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if v.is_cuda == param.is_cuda and v.device == param.device:
        return v
    return v.cuda(param.device) if param.is_cuda else v.cpu()


def _keeping_steps(opt, load, param_state) -> None:
    """`load(param_state)`, working around two things megatron-core 0.16.1 gets wrong with
    torch's AdamW (no TE/Apex optimizer): its loaders copy every key of the per-parameter
    state from the checkpoint's, and the gathered form has no `step` (KeyError); and its
    `load_state_dict` gives every parameter the same `step` tensor, which AdamW then
    increments in place once per parameter per step (wrong bias correction after a
    restore). The step is set aside, then each parameter gets its own copy."""
    state = opt.optimizer.state
    steps = {p: s.pop("step") for p, s in state.items() if "step" in s}
    try:
        load(param_state)
    finally:
        for p, step in steps.items():
            state[p]["step"] = step.clone()


def _megatron_config(cfg: OptimizerSettings, model_config, distributed: bool):
    """Megatron's OptimizerConfig for `consumer.optimizer` (lr fixed: no scheduler)."""
    from megatron.core.optimizer import OptimizerConfig

    adam, offload = cfg.name == "adamw", _offload_options(cfg)
    with _no_te_is_no_te_version() if offload else nullcontext():
        return OptimizerConfig(
            optimizer="adam" if adam else "sgd", lr=cfg.lr, min_lr=cfg.lr,
            weight_decay=cfg.weight_decay if adam else 0.0, decoupled_weight_decay=True,
            adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps, sgd_momentum=0.0,
            clip_grad=cfg.grad_clip, bf16=model_config.bf16, params_dtype=model_config.params_dtype,
            use_distributed_optimizer=distributed, **offload)


def _check_offload_device(cfg: OptimizerSettings) -> None:
    """megatron-core's HybridDeviceOptimizer needs CUDA (it takes CUDA streams when built,
    and offloads only CUDA tensors): refuse the offload without a GPU, before the model
    is wrapped, instead of its AssertionError."""
    if cfg.cpu_offload_fraction > 0 and not (torch.cuda.is_available() or gpu_standin.active()):
        raise ConfigError(f"consumer.optimizer.cpu_offload_fraction is {cfg.cpu_offload_fraction:g} but no "
                          "CUDA device is visible: the optimizer offload moves GPU state to the host; "
                          "set it to 0 on CPU", key="consumer.optimizer.cpu_offload_fraction")


def _offload_options(cfg: OptimizerSettings) -> dict:
    """megatron-core's optimizer CPU offload (HybridDeviceOptimizer) for
    `consumer.optimizer.cpu_offload_fraction` > 0, nothing otherwise. The offload runs
    on the precision-aware path of the distributed optimizer (Megatron-LM's
    megatron/training/arguments.py refuses the offload without `use_precision_aware_optimizer`:
    "the hybrid device optimizer reuses the code path of this flag"): without it the distributed
    optimizer would keep its fp32 master shards on the GPU and only the moments would
    move. The dtypes stay fp32 (masters, moments, gradients), as without offload."""
    if cfg.cpu_offload_fraction <= 0:
        return {}
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=cfg.cpu_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=cfg.cpu_offload_overlap, use_precision_aware_optimizer=True)


@contextmanager
def _no_te_is_no_te_version():
    """megatron-core 0.16.1's OptimizerConfig, with `use_precision_aware_optimizer`, asks
    `is_te_min_version("2.1.0")`, which compares None >= Version (TypeError) when
    Transformer Engine is absent. Absent is no version: answer False (its only effect
    there turns `store_param_remainders` off, which only TE's FusedAdam reads)."""
    from megatron.core.optimizer import optimizer_config
    from megatron.core.utils import get_te_version

    if get_te_version() is not None:
        yield
        return
    real = optimizer_config.is_te_min_version
    optimizer_config.is_te_min_version = lambda *args, **kwargs: False
    try:
        yield
    finally:
        optimizer_config.is_te_min_version = real
