"""CUDA streams, events, the current device and pinned host memory, for CPU processes.

    s = Stream()                      # torch.cuda.Stream() once installed
    with stream(s):                   # torch.cuda.stream(s)
        current_stream() is s         # torch.cuda.current_stream(), vLLM's current_stream()
    s.synchronize()                   # returns when every operation queued on s has ended

On a GPU a stream is a queue: work on it runs in order, and `synchronize` waits for
what was queued. CPU tensor operations run at once in the calling thread, so only
the stand-in NCCL's operations (common/gpu_standin/nccl.py) are queued: each runs
holding its stream, so one stuck on a stream blocks every later operation on that
stream and every `synchronize` of it, from any thread, exactly as a hung NCCL kernel
blocks a CUDA stream. Streams are handed to NCCL as integers (`cuda_stream`) and
found again here (`stream_of`); 0 is the default stream.

The current device is "cpu" (`torch.accelerator.current_device_index()` answers it):
vLLM's PyNcclCommunicator then binds its communicator to the device CPU tensors are
on. `cudaHostRegister` and `pin_memory` succeed and are counted (`pinned`), the
memory staying where it is.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass, field

import torch

DEVICE = "cpu"


class Stream:
    """A CUDA stream: operations on it run one at a time, in order."""

    _handles = itertools.count(1)
    _all: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()

    def __init__(self, device=None, priority: int = 0, handle: int | None = None, **_):
        self.device = torch.device(DEVICE)
        self.priority = priority
        self.cuda_stream = next(Stream._handles) if handle is None else handle
        self._lock = threading.RLock()
        Stream._all[self.cuda_stream] = self

    def run(self, op):
        """Run `op` on this stream: after everything queued before it, blocking whatever comes after."""
        with self._lock:
            return op()

    def synchronize(self) -> None:
        with self._lock:
            pass

    def query(self) -> bool:
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return True
        return False

    def wait_stream(self, other: "Stream") -> None:
        other.synchronize()

    def wait_event(self, event: "Event") -> None:
        event.synchronize()

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return hash(self.cuda_stream)

    def __repr__(self) -> str:
        return f"<stand-in cuda stream {self.cuda_stream}>"


@dataclass
class Event:
    """A CUDA event: marks the work queued on a stream so far."""

    enable_timing: bool = False
    blocking: bool = False
    interprocess: bool = False
    stream: Stream | None = field(default=None, repr=False)

    def record(self, stream: Stream | None = None) -> None:
        self.stream = stream or current_stream()

    def wait(self, stream: Stream | None = None) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def query(self) -> bool:
        return self.stream is None or self.stream.query()


DEFAULT = Stream(handle=0)
_tls = threading.local()


def current_stream(device=None) -> Stream:
    return getattr(_tls, "stream", None) or DEFAULT


def set_stream(s: Stream) -> None:
    _tls.stream = s


@contextlib.contextmanager
def stream(s: Stream | None):
    if s is None:
        yield
        return
    before = getattr(_tls, "stream", None)
    _tls.stream = s
    try:
        yield
    finally:
        _tls.stream = before


def stream_of(handle) -> Stream:
    """The stream behind the integer NCCL was given (`cudaStream_t(stream.cuda_stream)`)."""
    n = int(getattr(handle, "value", handle) or 0)
    s = Stream._all.get(n)
    if s is None:
        raise RuntimeError(f"CUDA error: invalid resource handle (stream {n})")
    return s


def current_device_index():
    return DEVICE


def synchronize(device=None) -> None:
    """`torch.accelerator.synchronize`: every stream's queued work has ended."""
    for s in list(Stream._all.values()):
        s.synchronize()


# ---------------------------------------------------------------- pinned host memory


class Pinned:
    """What was pinned or registered, by address: the stand-in's accounting."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.pinned_bytes = 0
        self.lock = threading.Lock()


pinned = Pinned()


class Cudart:
    """`torch.cuda.cudart()`: host registration (the weight snapshot's slab)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        with pinned.lock:
            if ptr in pinned.registered:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
            pinned.registered[ptr] = int(size)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        with pinned.lock:
            return 0 if pinned.registered.pop(ptr, None) is not None else 713  # cudaErrorHostMemoryNotRegistered


_cudart = Cudart()


def cudart() -> Cudart:
    return _cudart


def pin_memory(t: torch.Tensor, device=None) -> torch.Tensor:
    """A pinned copy (torch's `pin_memory` copies into the caching host allocator)."""
    out = t.clone()
    with pinned.lock:
        pinned.pinned_bytes += out.numel() * out.element_size()
    return out


def is_pinned(t: torch.Tensor, device=None) -> bool:
    return False
