"""Trainer state (model, optimizer) as plain tensors, for comparisons."""
from __future__ import annotations

import torch


def tensors_of(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state dict (dicts, lists, tuples), by path."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {prefix: state} if isinstance(state, torch.Tensor) else {}
    return {k: v for key, sub in items for k, v in tensors_of(sub, f"{prefix}/{key}").items()}


def params_of(trainer) -> dict[str, torch.Tensor]:
    """A copy of every model parameter, by name."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
