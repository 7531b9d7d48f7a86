"""CPU capture of the experts each MoE router picked, per request and token.

vLLM's native routed-experts return (`enable_return_routed_experts`) needs
Model Runner V2, which needs Triton: GPU only. On CPU we build the same data
from a hook every vLLM router exposes, `router.set_capture_fn(fn)`, which the
router calls with its `topk_ids` [num_tokens, top_k] on every forward.

How one engine step is mapped to requests (vLLM 0.32, V1 model runner):

1. The worker calls `model_runner.execute_model(scheduler_output)`. We wrap
   that bound method on the runner instance to open a "step" and remember
   `scheduler_output.num_scheduled_tokens` ({internal request id: count}).
2. Inside the forward, each layer's router calls our hook. On the first call
   of a step we snapshot the runner's batch layout: the order of requests
   (`input_batch.req_ids`), their scheduled token counts, and their
   `num_computed_tokens` (the position of their first row this step). This
   is exactly how the runner itself flattens the batch: rows are the requests
   in `input_batch` order, each contributing `num_scheduled_tokens[r]`
   consecutive rows at positions `num_computed_tokens[r] + 0, 1, ...`.
3. When `execute_model` returns, the step's [rows, top_k] per layer are
   stacked to [rows, L, top_k] and scattered to per-request buffers *by
   position*, so chunked prefill (a prompt split across steps) and preemption
   by recompute (positions re-run, rows overwritten) land in the right place.

A finished request's routing is `[P + T - 1, L, K]`: every prompt token and
every generated token except the last (which is sampled but never fed back).
`take()` refuses to return a buffer with holes; holes appear if prefix
caching skipped prefill rows, which is why capture needs
`producer.engine.enable_prefix_caching: false` (see docs/producer-engine.md).

Requirements: the model lives in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
tensor_parallel_size 1) and runs eagerly (`enforce_eager=True`) so the hook
is a plain Python call. No speculative decoding (rows would include drafts).
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from rlstream.common.errors import RoutingCaptureError
from rlstream.common.record import routing_dtype_for


def find_moe_routers(model: Any) -> list[tuple[int, Any]]:
    """[(layer_id, router)] of every vLLM MoE layer exposing `set_capture_fn`."""
    routers = []
    for _name, module in model.named_modules():
        router = getattr(module, "router", None)
        if router is not None and hasattr(router, "set_capture_fn") and hasattr(module, "layer_id"):
            routers.append((int(module.layer_id), router))
    routers.sort(key=lambda lr: lr[0])
    return routers


class _RequestRows:
    """Growable [capacity, L, K] buffer of one request's routing, filled by position."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype):
        self.rows = np.zeros((64, num_layers, top_k), dtype=dtype)
        self.filled = np.zeros(64, dtype=bool)

    def write(self, start: int, block: np.ndarray) -> None:
        end = start + block.shape[0]
        if end > self.rows.shape[0]:
            cap = max(end, 2 * self.rows.shape[0])
            self.rows = np.concatenate([self.rows, np.zeros((cap - self.rows.shape[0],) + self.rows.shape[1:], self.rows.dtype)])
            self.filled = np.concatenate([self.filled, np.zeros(cap - self.filled.shape[0], bool)])
        self.rows[start:end] = block
        self.filled[start:end] = True


class RoutingCapture:
    """Routed-expert capture for an in-process vLLM CPU model runner.

    `RoutingCapture(runner, num_experts).install()` hooks every router;
    `take(internal_request_id, num_rows)` returns the request's routing
    [num_rows, L, K] and forgets it; `rows_so_far` returns a running request's rows and keeps
    them (a turn journaled while it generates); `discard(id)` forgets an aborted request.
    All calls happen on the engine's thread.
    """

    def __init__(self, model_runner: Any, num_experts: int):
        self.runner = model_runner
        self.num_experts = int(num_experts)
        self.dtype = routing_dtype_for(self.num_experts)
        self.routers = find_moe_routers(model_runner.model)
        if not self.routers:
            raise RoutingCaptureError("no MoE router with set_capture_fn found in the model")
        self.layer_ids = [lid for lid, _ in self.routers]
        self.num_layers = len(self.routers)
        self.top_k = int(self.routers[0][1].top_k)
        self._requests: dict[str, _RequestRows] = {}
        self._step: dict[str, Any] | None = None
        self.steps_captured = 0
        # (req_ids, counts, starts) of the last steps, for diagnostics and tests
        self.recent_layouts: deque[tuple[list[str], list[int], list[int]]] = deque(maxlen=256)

    # -- installation ------------------------------------------------------
    def install(self) -> "RoutingCapture":
        """Hook the routers and wrap `execute_model` (idempotent; call again after a reload)."""
        routers = find_moe_routers(self.runner.model)
        if [lid for lid, _ in routers] != self.layer_ids:
            raise RoutingCaptureError("the MoE layers changed since the capture was set up")
        self.routers = routers
        for slot, (_lid, router) in enumerate(self.routers):
            router.set_capture_fn(lambda ids, slot=slot: self._on_router(slot, ids))
        if not getattr(self.runner, "_rlstream_capture_wrapped", False):
            original = self.runner.execute_model

            def execute_model(scheduler_output, *args, **kwargs):
                self._begin(scheduler_output)
                try:
                    return original(scheduler_output, *args, **kwargs)
                finally:
                    self._end()

            self.runner.execute_model = execute_model
            self.runner._rlstream_capture_wrapped = True
        return self

    def uninstall(self) -> None:
        for _lid, router in self.routers:
            router.set_capture_fn(None)

    # -- per step ----------------------------------------------------------
    def _begin(self, scheduler_output: Any) -> None:
        self._step = {"sched": dict(scheduler_output.num_scheduled_tokens),
                      "total": int(scheduler_output.total_num_scheduled_tokens),
                      "layout": None, "layers": [None] * self.num_layers}

    def _on_router(self, slot: int, topk_ids: Any) -> None:
        step = self._step
        if step is None:  # profile / dummy runs outside an engine step
            return
        if step["layout"] is None:
            batch = self.runner.input_batch
            req_ids = list(batch.req_ids[: batch.num_reqs])
            counts = [step["sched"][r] for r in req_ids]
            starts = [int(batch.num_computed_tokens_cpu[batch.req_id_to_index[r]]) for r in req_ids]
            step["layout"] = (req_ids, counts, starts)
        total = step["total"]
        if topk_ids.shape[0] < total:
            raise RoutingCaptureError(
                f"router of layer slot {slot} saw {topk_ids.shape[0]} rows, "
                f"{total} tokens were scheduled")
        # rows beyond `total` are padding; copy now, the tensor is reused.
        step["layers"][slot] = topk_ids[:total].to("cpu").numpy().astype(self.dtype, copy=True)

    def _end(self) -> None:
        step, self._step = self._step, None
        if step is None or step["total"] == 0 or step["layout"] is None:
            return
        missing = [self.layer_ids[i] for i, a in enumerate(step["layers"]) if a is None]
        if missing:
            raise RoutingCaptureError(
                f"routers of layers {missing} were not called in this step; "
                "run the engine eagerly (enforce_eager=True)")
        rows = np.stack(step["layers"], axis=1)  # [total, L, K]
        req_ids, counts, starts = step["layout"]
        if sum(counts) != rows.shape[0]:
            raise RoutingCaptureError(f"scheduled {sum(counts)} tokens, captured {rows.shape[0]} rows")
        offset = 0
        for req_id, n, start in zip(req_ids, counts, starts):
            buf = self._requests.get(req_id)
            if buf is None:
                buf = self._requests[req_id] = _RequestRows(self.num_layers, self.top_k, self.dtype)
            buf.write(start, rows[offset: offset + n])
            offset += n
        self.steps_captured += 1
        self.recent_layouts.append(step["layout"])

    # -- results -----------------------------------------------------------
    def take(self, request_id: str, num_rows: int) -> np.ndarray:
        """Routing [num_rows, L, K] of a finished request (positions 0..num_rows-1)."""
        try:
            return self.rows_so_far(request_id, num_rows)
        finally:
            self._requests.pop(request_id, None)  # forgotten, also when refused

    def rows_so_far(self, request_id: str, num_rows: int) -> np.ndarray:
        """Routing [num_rows, L, K] of a request, finished or still running (kept)."""
        buf = self._requests.get(request_id)
        if buf is None:
            raise RoutingCaptureError(f"no routing captured for request {request_id!r}")
        if buf.rows.shape[0] < num_rows or not buf.filled[:num_rows].all():
            have = int(buf.filled[:num_rows].sum()) if buf.rows.shape[0] >= num_rows else int(buf.filled.sum())
            raise RoutingCaptureError(
                f"request {request_id!r}: {have} of {num_rows} routing rows captured "
                "(prefix caching on? it skips prefill rows)")
        return buf.rows[:num_rows].copy()

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._requests)
