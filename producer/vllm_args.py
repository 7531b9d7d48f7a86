"""EngineSettings -> vLLM: the settings made concrete for the platform, and the
vllm.EngineArgs of them (pure: unit-tested without vLLM).

The settings are `rlstream.common.config.EngineSettings`, validated when the config
loads; what needs the platform (what `routing: auto` and `weight_transfer: auto`
resolve to, a KV-cache budget on CPU) is checked here, when `RolloutEngine`
(producer/engine.py) starts, with a ConfigError naming the key.
"""
from __future__ import annotations

import os
from typing import Any

from rlstream.common import gpu_standin
from rlstream.common.config import EngineSettings
from rlstream.common.errors import ConfigError
from rlstream.common.weights.backends import NCCL
from rlstream.common.weights.backends import resolve as resolve_backend
from rlstream.producer.weights.port import WORKER_EXTENSION


def resolve_routing(s: EngineSettings, on_cpu: bool) -> str:
    """`routing: auto` made concrete for the platform, plus the rules that need the
    platform (an explicit `capture` was already checked when the config loaded)."""
    mode = s.routing
    if mode == "auto":
        mode = "capture" if on_cpu else "native"
    if mode == "native" and on_cpu:
        raise ConfigError("native (enable_return_routed_experts) needs Triton (GPU); use capture on CPU",
                          key="producer.engine.routing")
    if mode == "native" and s.enable_prefix_caching is False:
        raise ConfigError("routing native needs it true: vLLM 0.32's routed-experts output (the AuxOutput "
                          "connector) refuses to start without prefix caching; the cache is salted per "
                          "weight version", key="producer.engine.enable_prefix_caching")
    if mode == "capture" and (s.tensor_parallel_size != 1 or not s.enforce_eager or s.enable_prefix_caching):
        raise ConfigError("routing auto means capture on CPU, which needs tensor_parallel_size 1, "
                          "enforce_eager and no prefix caching", key="producer.engine.routing")
    if on_cpu and s.kv_cache_memory_bytes is None:
        raise ConfigError("required on CPU (vLLM's default reserves 92 % of RAM)",
                          key="producer.engine.kv_cache_memory_bytes")
    return mode


def prefix_caching(s: EngineSettings, routing_mode: str) -> bool:
    """`enable_prefix_caching` made concrete: unset means on exactly with native routing."""
    return routing_mode == "native" if s.enable_prefix_caching is None else s.enable_prefix_caching


def resolve_weight_transfer(s: EngineSettings, on_cpu: bool) -> str | None:
    """`weight_transfer: auto` made concrete: the vLLM weight-transfer backend, or None (off)."""
    mode = resolve_backend(s.weight_transfer, on_gpu=not on_cpu)
    if mode == NCCL and on_cpu and not gpu_standin.requested():
        raise ConfigError("nccl needs a GPU (on CPU only over the test stand-ins, RLSTREAM_GPU_STANDIN=1); use "
                          "rlstream_gloo (or auto) on CPU", key="producer.engine.weight_transfer")
    return None if mode == "off" else mode


def engine_args(s: EngineSettings, model_dir: str | os.PathLike, routing_mode: str, on_cpu: bool,
                weight_transfer: str | None = None) -> dict[str, Any]:
    """vllm.EngineArgs of the settings, with the choices the step-level contract fixes."""
    args = dict(
        model=str(model_dir), dtype=s.dtype, max_model_len=s.max_model_len,
        tensor_parallel_size=s.tensor_parallel_size, seed=s.seed,
        max_num_seqs=s.max_num_seqs, enforce_eager=s.enforce_eager,
        logprobs_mode=s.logprobs_mode,
        # Off by default: n samples of one prompt would hit the prefix cache
        # and skip the prefill rows the routing capture needs; RL prompts are
        # short next to their responses, so recomputing them is cheap.
        enable_prefix_caching=prefix_caching(s, routing_mode),
        enable_chunked_prefill=s.enable_chunked_prefill,
        # one forward per step(): reloads land between forwards, and the
        # tokens of a step are produced by the weights current at step().
        async_scheduling=False,
        disable_log_stats=True,
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        # rlstream's worker RPCs (weight status, CPU MoE repack), by name (producer/weights/port.py)
        worker_extension_cls=WORKER_EXTENSION,
    )
    if weight_transfer is not None:
        args["weight_transfer_config"] = {"backend": weight_transfer}
    if s.block_size is not None:
        args["block_size"] = s.block_size
    if s.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = s.max_num_batched_tokens
    if not on_cpu:
        args["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.quantization != "none":
        args["quantization"] = s.quantization
    if routing_mode == "native":  # GPU only: not exercised by the CPU test suite
        args["enable_return_routed_experts"] = True
    args.update(s.extra_engine_args)  # last: the escape hatch (config refuses keys with a setting)
    return args
