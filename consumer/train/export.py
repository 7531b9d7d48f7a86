"""The trainer's current weights as vLLM's `WeightSource`: HF names, one layer group at a time.

    source = trainer.weight_source()            # on every rank, in step (a collective)
    source.metadata()                          # ParamMeta per HF tensor, without gathering
    for names, tensors in source.iter_groups():  # rank 0: the group's HF tensors; others: None
        ...

Groups are the embedding, each decoder layer, then the final norm and lm_head
(consumer/train/layout.py `hf_groups`, vLLM's `layerwise_groups` of the HF names).
Each group is gathered to global rank 0, the sender, only within the groups
that hold its shards, and freed before the next (memory: one layer):

- tensor-parallel shards over the TP group of rank 0 (the data-parallel-rank-0
  ranks), joined per weight (consumer/train/layout.py `tp_join`);
- expert shards, on the first expert-data-parallel replica only: over their
  expert-TP group, then the TP-rank-0 ranks over the expert-parallel group,
  renumbered to global expert ids.

One `dist.gather` of a flat byte buffer per group and dimension (not one per
tensor), never a world-wide `all_gather_object`: that gathered every rank's
whole shard everywhere (about 83 GB of GPU buffer on 8 ranks at 30B-A3B).
Ranks outside those groups skip the collective. Data parallelism alone needs no
communication at all (rank 0 holds everything).

Non-sender ranks yield None for every tensor and hold the same groups (they
must iterate in step; vLLM's `held_names` contract is for engines, which only
rank 0 feeds). The class implements vLLM's `WeightSource` interface without
importing vLLM (a 6 s import): consumer/weights/backend.py registers it as a virtual
subclass for the engines that check.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlstream.consumer.train import layout
from rlstream.consumer.train.parallel import world


@dataclass(frozen=True)
class _ParamMeta:
    """vLLM's `ParamMeta` fields, for machines without vLLM."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class MegatronSource:
    def __init__(self, model):
        self.model, self.dims = model, model.hf_dims
        self.dtype = next(model.parameters()).dtype
        self._groups = layout.hf_groups(self.dims)

    def metadata(self) -> list:
        """vLLM `ParamMeta` (name, dtype, full HF shape) of every tensor, without gathering;
        the same fields in a record of our own where vLLM is not installed (a trainer
        machine exporting to a durable store, tests/bench/weights_export.py on a GPU image)."""
        try:
            from vllm.distributed.weight_transfer.base import ParamMeta
        except ImportError:
            ParamMeta = _ParamMeta
        return [ParamMeta(n, self.dtype, shape) for g in self._groups for n, shape in g]

    def shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """(HF name, shape) per group: the metadata without vLLM."""
        return [list(g) for g in self._groups]

    def held_names(self) -> None:
        return None

    def groups(self) -> list[list[str]]:
        return [[n for n, _ in g] for g in self._groups]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor | None]]]:
        """Collective on every rank: the HF tensors of each group on rank 0 (views of the
        live weights where the layouts agree: consume them before the next optimizer step)."""
        by_group: dict[int, dict[str, torch.Tensor]] = {g: {} for g in range(len(self._groups))}
        for name, t in layout.local_megatron_state_dict(self.model).items():
            by_group[layout.megatron_group_of(name, self.dims)][name] = t.detach()
        sender = world() == 1 or _rank() == 0
        for g, names in enumerate(self.groups()):
            full = _gather_to_sender(by_group.pop(g), self.dims)
            if not sender:
                yield names, [None] * len(names)
                continue
            hf = layout.megatron_group_to_hf(full, g, self.dims)
            yield names, [hf[n] for n in names]


def collect(source) -> dict[str, torch.Tensor]:
    """Iterate `source` once (a collective on every rank) into {HF name: contiguous CPU
    tensor}: the whole model on rank 0, an empty dict elsewhere."""
    out: dict[str, torch.Tensor] = {}
    for names, tensors in source.iter_groups():
        out.update({n: t.detach().cpu().contiguous() for n, t in zip(names, tensors) if t is not None})
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# ---------------------------------------------------------------- gathers


def _gather_to_sender(part: dict[str, torch.Tensor], dims) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors of one group -> the full (unsharded) ones on rank 0."""
    if world() == 1:
        return part
    from megatron.core import parallel_state as ps

    dense = {k: v for k, v in part.items() if not layout.EXPERT_RE.match(k)}
    experts = {k: v for k, v in part.items() if layout.EXPERT_RE.match(k)}
    out: dict[str, torch.Tensor] = {}
    if ps.get_data_parallel_rank() == 0:  # rank 0's TP group holds the dense weights
        out.update(_join_tp(dense, ps.get_tensor_model_parallel_group(), dims))
    if experts and ps.get_expert_data_parallel_rank() == 0:  # one replica of every expert shard
        joined = _join_tp(experts, ps.get_expert_tensor_parallel_group(), dims)
        if ps.get_expert_tensor_parallel_rank() == 0:
            out.update(_join_ep(joined, ps.get_expert_model_parallel_group(), dims))
    return out


def _join_tp(tensors: dict[str, torch.Tensor], group, dims) -> dict[str, torch.Tensor]:
    """TP shards -> whole tensors on the group's rank 0 ({} elsewhere). Weights every
    TP rank holds whole (norms, router) are taken from rank 0 as they are."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return dict(tensors)
    split = sorted(k for k in tensors if layout.tp_rule(k))
    parts = _gather_flat([tensors[k] for k in split], group)
    if parts is None:
        return {}
    out = {k: v for k, v in tensors.items() if k not in split}
    for i, k in enumerate(split):
        out[k] = layout.tp_join([p[i] for p in parts], *layout.tp_rule(k), dims)
    return out


def _join_ep(tensors: dict[str, torch.Tensor], group, dims) -> dict[str, torch.Tensor]:
    """Each expert-parallel rank's local experts -> every expert, globally numbered, on
    the group's rank 0 ({} elsewhere)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return dict(tensors)
    names = sorted(tensors)
    parts = _gather_flat([tensors[k] for k in names], group)
    if parts is None:
        return {}
    per_rank, out = dims.num_experts // size, {}
    for r, ts in enumerate(parts):
        for k, t in zip(names, ts):
            m = layout.EXPERT_RE.match(k)
            out[f"{m.group(1)}{int(m.group(2)) + r * per_rank}{m.group(3)}"] = t
    return out


def _gather_flat(tensors: list[torch.Tensor], group) -> list[list[torch.Tensor]] | None:
    """One `dist.gather` of the tensors' bytes to the group's rank 0: per group rank,
    tensors shaped like these (the ranks' shards have equal shapes). None off rank 0."""
    import torch.distributed as dist

    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    me, size = dist.get_rank(group), dist.get_world_size(group)
    bufs = [torch.empty_like(flat) for _ in range(size)] if me == 0 else None
    dist.gather(flat, bufs, group=group, group_dst=0)
    if bufs is None:
        return None
    sizes = [t.numel() * t.element_size() for t in tensors]
    return [[p.view(t.dtype).view(t.shape) for p, t in zip(b.split(sizes), tensors)] for b in bufs]


def export_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """On-disk HF tensors of the current weights, ready for safetensors `save_file`.

    Collective when tensor/expert parallel (call on every rank): gathered one
    layer group at a time within the groups that hold the shards
    (`collect` below). The whole dict on rank 0 (contiguous CPU
    tensors in the model's dtype); other ranks get an empty dict.
    """
    return collect(MegatronSource(model))
