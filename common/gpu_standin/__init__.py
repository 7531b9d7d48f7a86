"""CPU stand-ins for the innermost GPU libraries, so that the GPU path's Python runs on CPU.

    RLSTREAM_GPU_STANDIN=1 rlstream producer ...   # every process of the run installs them
    with installed(): ...                          # in a test, for a block

Only the bottom is replaced: libnccl (vLLM's `NCCLLibrary`, over TCP: `nccl.py`, `ring.py`),
CUDA streams and events, the current device, and pinned or registered host memory
(`cuda.py`). Everything above runs as it does on a GPU cluster: vLLM's
`PyNcclCommunicator` and its weight-transfer engines (`nccl`: trainer init,
`send_weights`, the worker's init at its rank offset, the packed double-buffered
broadcasts), Megatron's `HybridDeviceOptimizer`, and rlstream's fan-out, digests,
watchdogs and restore. A test never changes what rlstream hands to those.

Where it is installed: vLLM calls the `vllm.general_plugins` entry point
`rlstream_gpu_standin` (pyproject.toml) in each of its processes (engine core and
workers); rlstream's CLI calls `install_if_requested` before it starts a role;
spawned test and bench children call it themselves. Nothing is installed unless
`RLSTREAM_GPU_STANDIN` is set: a GPU machine never runs it.

- `nccl.py`  StandinNccl: ncclGetUniqueId / ncclCommInitRank / ncclBroadcast / ... /
             ncclCommAbort with NCCL's blocking and abort behaviour.
- `cuda.py`  Stream, Event, current_stream, stream(), cudart(), pin_memory.
"""
from __future__ import annotations

import contextlib
import logging
import os

ENV = "RLSTREAM_GPU_STANDIN"

_saved: list[tuple[object, str, object]] = []


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def active() -> bool:
    """The stand-ins are installed in this process."""
    return bool(_saved)


def install_if_requested() -> None:
    """The vLLM plugin and the CLI: install when `RLSTREAM_GPU_STANDIN` is set."""
    if requested():
        install()


def install() -> None:
    """Put the stand-ins in place in this process (idempotent)."""
    if _saved:
        return
    import torch

    from rlstream.common.gpu_standin import cuda  # defers torch

    _patch(torch.cuda, "Stream", cuda.Stream)
    _patch(torch.cuda, "Event", cuda.Event)
    _patch(torch.cuda, "current_stream", cuda.current_stream)
    _patch(torch.cuda, "set_stream", cuda.set_stream)
    _patch(torch.cuda, "stream", cuda.stream)
    _patch(torch.cuda, "cudart", cuda.cudart)
    _patch(torch.accelerator, "current_device_index", cuda.current_device_index)
    _patch(torch.accelerator, "synchronize", cuda.synchronize)
    _patch(torch.cuda, "synchronize", cuda.synchronize)
    _patch(torch.Tensor, "pin_memory", cuda.pin_memory)
    _patch(torch, "empty", _empty_pinnable(torch.empty))
    _install_vllm()
    logging.getLogger("rlstream").info("GPU stand-ins installed in process %d (libnccl over TCP, CUDA streams, "
                                       "pinned memory): not a GPU run", os.getpid())


def _install_vllm() -> None:
    try:
        from vllm.distributed.device_communicators import pynccl
        from vllm.utils import torch_utils
    except ImportError:  # a trainer without vLLM never reaches NCCL through it
        return
    from rlstream.common.gpu_standin import cuda  # defers torch
    from rlstream.common.gpu_standin.nccl import StandinNccl  # defers torch

    _patch(pynccl, "NCCLLibrary", StandinNccl)
    _patch(pynccl, "current_stream", cuda.current_stream)
    _patch(torch_utils, "current_stream", cuda.current_stream)


def uninstall() -> None:
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)


@contextlib.contextmanager
def installed():
    """The stand-ins for one block (unit tests share their process with other tests)."""
    was = active()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def _patch(owner, name: str, value) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _empty_pinnable(empty):
    """torch.empty accepting `pin_memory=True` (Megatron's offload pins its gradient copies)."""
    from rlstream.common.gpu_standin import cuda  # defers torch

    def pinnable(*args, pin_memory: bool = False, **kwargs):
        out = empty(*args, **kwargs)
        if pin_memory:
            with cuda.pinned.lock:
                cuda.pinned.pinned_bytes += out.numel() * out.element_size()
        return out

    return pinnable
