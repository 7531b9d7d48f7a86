"""What the Megatron model's routers dispatched with, seen from forward hooks (the
replay tests on CPU and on CUDA).

    routing_used     context manager: one sorted [N, K] expert index tensor per router call
    sorted_routing   a routing tensor with each row's experts sorted, to compare with the above
"""
from __future__ import annotations

import contextlib

import torch

from rlstream.consumer.train import replay


@contextlib.contextmanager
def routing_used(model):
    """Collect the routing each router actually dispatched with: one [N, K]
    sorted index tensor per router call, in call order."""
    calls, handles = [], []

    def hook(module, args, output):
        routing_map = output[1]
        calls.append(torch.topk(routing_map.float(), module.topk, -1).indices.sort(-1).values)

    for r in replay.routers(model):
        handles.append(r.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def sorted_routing(r: torch.Tensor) -> torch.Tensor:
    return r.long().sort(-1).values
