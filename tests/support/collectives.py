"""What the trainer sends through torch.distributed, and where its tensors live
(tests/integration/test_trainer_collectives.py).

    with recorded() as calls, torch.device("meta"):   # tensors made without a device: meta
        trainer.train_step(gb)
    calls -> [Call(name, group, devices), ...]

NCCL serves CUDA tensors only, so on a GPU every collective of a non-gloo group
must carry tensors on the model's device. On the CPU test machine every group
is gloo and every tensor is on the CPU, which would make that check vacuous;
running the step with "meta" as the default device makes it bite: a tensor
created without an explicit device (the old `torch.zeros(2)` of the gradient
norm, `torch.tensor(values)` of the metric sums: on a GPU node, CPU tensors)
is a meta tensor, and the recorder refuses any collective on one
(`MetaCollective`, before anything is sent, so no rank hangs). Explicitly
placed CPU tensors still pass on CPU: the check cannot tell them apart.

`host_groups()` are Megatron's gloo groups, the ones named as such, where host
tensors belong (the distributed optimizer's checkpoint gather).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
         "_all_gather_base", "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter",
         "all_to_all", "all_to_all_single", "reduce_scatter")


class MetaCollective(RuntimeError):
    """A collective was asked to send a tensor created without a device."""


@dataclass
class Call:
    name: str
    group: object
    devices: set[str]


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _recording(name: str, original, calls: list[Call]):
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        devices = {str(t.device) for a in (*args, *kwargs.values()) for t in _tensors(a)}
        group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        calls.append(Call(name, group, devices))
        if "meta" in devices:
            raise MetaCollective(f"{name} on a tensor made without a device: {devices}")
        return original(*args, **kwargs)
    return call


@contextlib.contextmanager
def recorded():
    """Every collective inside the block, through torch.distributed and the
    aliases Megatron binds at import (param_and_grad_buffer)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    calls: list[Call] = []
    targets = [(dist, n) for n in NAMES if hasattr(dist, n)]
    targets += [(pgb, n) for n in ("dist_all_gather_func", "dist_reduce_scatter_func")]
    saved = [(mod, n, getattr(mod, n)) for mod, n in targets]
    for mod, n, fn in saved:
        setattr(mod, n, _recording(n, fn, calls))
    try:
        yield calls
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)


def host_groups() -> list:
    """Megatron's gloo process groups (host tensors belong there)."""
    from megatron.core import parallel_state as ps

    out = []
    for cp in (False, True):
        for partial in (False, True):
            with contextlib.suppress(Exception):
                out.append(ps.get_data_parallel_group_gloo(with_context_parallel=cp,
                                                           partial_data_parallel=partial))
    for partial in (False, True):
        with contextlib.suppress(Exception):
            out.append(ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=partial))
    return [g for g in out if g is not None]


def misplaced(calls: list[Call], device: torch.device) -> list[Call]:
    """Calls whose tensors are not where their group serves them: the model's
    device, or the CPU on a host (gloo) group."""
    hosts = host_groups()
    want = {str(device)}
    return [c for c in calls if c.devices and not c.devices
            <= ({"cpu"} if any(c.group is g for g in hosts) else want)]
