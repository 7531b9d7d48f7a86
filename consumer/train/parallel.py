"""Distributed helpers of the trainer: the parallel layout, Megatron's groups,
the reductions the trainer issues itself, the sequence split of sequence parallelism.

    layout = ParallelLayout.of(cfg.consumer.parallel, launch_world_size())
    init_parallel(layout)                          # torch.distributed + Megatron groups, once
    close_parallel()                               # both torn down (at exit by itself on gloo)
    reduce_over_data_parallel(metric_sums, "sum")  # step metrics, one message
    reduce_over_tensor_parallel(t, "max")          # vocabulary-parallel entropy

Layout: world size = tp * dp, ep divides dp (Megatron carves expert-parallel
groups out of the data-parallel ranks); experts are split over the same tp
ranks as the dense layers (expert TP = tp). Every helper is a no-op, or the
identity, in a world of one.

Devices. Every reduction here takes tensors on the model's device: NCCL (GPU)
serves CUDA tensors only, gloo (CPU) both. Host tensors go over a gloo group
named as such (`data_parallel_gloo_group`). Gradient reduction and clipping are
Megatron's (consumer/train/optimizer.py), on the gradient buffers' device.
tests/integration/test_trainer_collectives.py records every collective of a
multi-rank step and checks the devices.

On CPU: gloo, and the shims of consumer/train/megatron_shims.py. On GPU: NCCL, the
same code.
"""
from __future__ import annotations

import atexit
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlstream.common.config import ParallelSettings
from rlstream.common.errors import ParallelLayoutError

# torch and Megatron are imported where they are used: the service imports
# this module for `launch_rank`, before any engine starts.
if TYPE_CHECKING:
    import torch

# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class ParallelLayout:
    """The resolved layout of one job: tensor, expert and data-parallel sizes."""

    tp: int = 1
    ep: int = 1
    dp: int = 1

    @classmethod
    def of(cls, settings: ParallelSettings, world_size: int) -> "ParallelLayout":
        """`consumer.parallel` in a world of `world_size` processes (dp = world / tp)."""
        return cls(tp=settings.tensor, ep=settings.expert, dp=settings.data_parallel(world_size))

    def validate(self, world_size: int) -> None:
        if min(self.tp, self.ep, self.dp) < 1:
            raise ParallelLayoutError("tp, ep and dp must be >= 1", "consumer.parallel")
        if self.tp * self.dp != world_size:
            raise ParallelLayoutError(f"tp*dp = {self.tp * self.dp} but world size is {world_size}; "
                                      "launch tp*dp processes (torchrun --nproc_per_node)",
                                      "consumer.parallel.tensor")
        if self.dp % self.ep:
            raise ParallelLayoutError(f"ep={self.ep} must divide dp={self.dp}", "consumer.parallel.expert")


def launch_rank() -> int:
    """This process's rank as the launcher set it (torchrun's RANK; 0 alone)."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """Processes in the job as the launcher set it (torchrun's WORLD_SIZE; 1 alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---------------------------------------------------------------- parallel state


def init_parallel(par: ParallelLayout = ParallelLayout()) -> None:
    """Initialise torch.distributed and Megatron's groups once per process.

    Under torchrun (RANK/WORLD_SIZE set) uses env://; otherwise a world of one
    through a FileStore in a temp dir (no port to pick). gloo on CPU, nccl on
    GPU. A second call with the same layout is a no-op; a different layout
    raises (Megatron's groups are process-global). A gloo world it creates is
    torn down at exit (close_parallel, below).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlstream.consumer.train import megatron_shims  # defers torch

    megatron_shims.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend)
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="rlstream-dist-"), "store")
            dist.init_process_group(backend=backend, init_method=f"file://{store}",
                                    rank=0, world_size=1)
        if backend == "gloo":
            atexit.register(close_parallel)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    par.validate(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (par.tp, par.ep):
            raise ParallelLayoutError(f"parallel state already initialised with tp,ep={have}",
                                      "consumer.parallel")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=par.tp,
                                 expert_model_parallel_size=par.ep)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)


def close_parallel() -> None:
    """Tear down Megatron's groups and torch.distributed in this process (nothing if neither is up).

    init_parallel registers it at exit for a gloo world, so it runs while the interpreter is
    still whole. A gloo process group left to the interpreter's finalization can abort the
    process ("terminate called without an active exception", SIGABRT) after its work is done:
    its worker threads may still hold tensors whose release needs the GIL the finalizing
    interpreter no longer gives (pytorch/pytorch#179291, #190489). Not registered for NCCL:
    its teardown is left to the launcher, as before.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def world() -> int:
    """Processes in torch.distributed's world (1 before it is initialised)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def dp_size() -> int:
    """Ranks holding different data (tensor-parallel ranks share theirs)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if world() > 1 else 1


def ranks() -> tuple[int, int, int, int]:
    """(tp rank, tp size, ep rank, ep size) of this process."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


# ---------------------------------------------------------------- reductions


OPS = {"sum": "SUM", "max": "MAX"}


def _all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    import torch.distributed as dist

    if world() > 1 and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, OPS[op]), group=group)
    return t


def reduce_over_data_parallel(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`op` ("sum" or "max") of `t` over the data-parallel ranks, in place.

    `t` must live on the model's device (NCCL serves CUDA tensors only): the
    trainer keeps its step metrics there. Tensor-parallel ranks hold the same
    values, so they are not reduced over."""
    from megatron.core import parallel_state as ps

    return _all_reduce(t, op, ps.get_data_parallel_group() if world() > 1 else None)


def reduce_over_tensor_parallel(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`op` of `t` over the tensor-parallel ranks, in place (`t` on the model's device)."""
    from megatron.core import parallel_state as ps

    return _all_reduce(t, op, ps.get_tensor_model_parallel_group() if world() > 1 else None)


def data_parallel_gloo_group():
    """Megatron's gloo group over the data-parallel ranks: for host tensors only
    (checkpoint gathers of the distributed optimizer use it)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group_gloo()


# ---------------------------------------------------------------- sequence parallelism


def sequence_shard(model) -> tuple[int, int]:
    """(rank, size) of the sequence split of sequence parallelism; (0, 1) without."""
    if not model.config.sequence_parallel:
        return 0, 1
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def padded_length(seq: int, model) -> int:
    """The forward's sequence length: `seq` rounded up to a multiple of the
    sequence-parallel size (the sequence is split evenly over TP ranks)."""
    size = sequence_shard(model)[1]
    return -(-seq // size) * size


def gather_sequence(model, layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-gather each layer's [S/tp*B, K] over the TP group -> [S*B, K]."""
    if sequence_shard(model)[1] == 1:
        return layers
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out = []
    for t in layers:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        out.append(torch.cat(parts, 0))
    return out
