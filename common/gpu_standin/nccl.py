"""`NCCLLibrary` (vLLM's ctypes binding of libnccl) over gloo, for CPU processes.

    lib = GlooNccl()                         # what vLLM's PyNcclCommunicator gets
    uid = lib.ncclGetUniqueId()              # rank 0: a bootstrap store on this host
    comm = lib.ncclCommInitRank(world, uid, rank)
    lib.ncclBroadcast(send, recv, count, dtype, root, comm, stream)   # on `stream`, in order
    lib.ncclCommAbort(comm)                  # ends whatever is blocked in it; later calls fail

Everything above this class is vLLM's own code: `PyNcclCommunicator` (its rendezvous
over `StatelessProcessGroup`, the unique id's broadcast, the warm-up all-reduce, its
`disabled` flag after `destroy`), the weight-transfer engines and the packed
broadcasts. Buffers are the raw pointers vLLM passes (`buffer_type(t.data_ptr())`):
on CPU they are host memory, read and written in place.

What NCCL does and this does too:
- **Stream order.** An operation runs on the stream it is given, after the work
  queued there before it (common/gpu_standin/cuda.py `Stream`): a transfer stuck on a
  cached stream blocks every later one on that stream, as on a GPU.
- **A dead or silent peer blocks.** NCCL has no timeout: a collective whose peer died
  waits until the communicator is aborted. Here gloo's error (its peer's socket closed,
  or its own timeout) does not end the operation either: it waits for `ncclCommAbort`.
- **Abort ends it.** `ncclCommAbort` releases every operation blocked in the
  communicator with an NCCL error; any later call on it fails ("invalid usage").

What it does not model: NCCL's asynchronous error reporting (ncclCommGetAsyncError),
bandwidth, and the GPU's own memory. The unique id carries `host:port` of a
TCPStore on rank 0's host (NCCL's carries the address of its bootstrap socket), on
the interface `NCCL_SOCKET_IFNAME` names, else the first one that is up and not
loopback, as NCCL picks its own.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from common.gpu_standin import cuda

VERSION = 22805
"""The NCCL version reported (2.28.5: the nvidia-nccl-cu13 torch 2.13 pins)."""
STORE_TIMEOUT = timedelta(seconds=300)
"""The bootstrap's rendezvous bound (NCCL's own bootstrap waits about as long)."""
GLOO_TIMEOUT = timedelta(hours=1)
"""Gloo's own bound on one operation; when it passes, the operation still waits for an abort."""
POLL_S = 0.05
"""How often a blocked operation looks for an abort."""

DTYPES = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 3: torch.int32, 4: torch.int64, 5: torch.int64,
          6: torch.float16, 7: torch.float32, 8: torch.float64, 9: torch.bfloat16, 10: torch.float8_e4m3fn}
"""ncclDataType_t -> a torch dtype of the same width (unsigned ones as their signed twin:
broadcast, send and receive move bytes; sums of unsigned ints are not used here)."""
OPS = {0: "SUM", 1: "PRODUCT", 2: "MAX", 3: "MIN", 4: "AVG"}


class NcclStandinError(RuntimeError):
    """What vLLM's NCCL_CHECK raises for an NCCL error code."""

    def __init__(self, what: str):
        super().__init__(f"NCCL error: {what}")


@dataclass
class Comm:
    """One communicator: a gloo group of `world_size` ranks."""

    pg: object
    rank: int
    world_size: int
    aborted: threading.Event = field(default_factory=threading.Event)


_comms: dict[int, Comm] = {}
_roots: dict[bytes, object] = {}  # rank 0's bootstrap stores, kept alive for the group's life
_lock = threading.Lock()


class GlooNccl:
    """The methods of vLLM's `NCCLLibrary` that its communicators call."""

    def __init__(self, so_file: str | None = None):
        self.so_file = so_file

    def has_symbol(self, name: str) -> bool:
        return name in ("ncclCommAbort", "ncclCommDestroy", "ncclGroupStart", "ncclGroupEnd")

    def ncclGetErrorString(self, result: int) -> str:
        return f"stand-in error {result}"

    def ncclGetRawVersion(self) -> int:
        return VERSION

    def ncclGetVersion(self) -> str:
        return "2.28.5 (CPU stand-in over gloo)"

    # -- communicators

    def ncclGetUniqueId(self):
        from torch.distributed import TCPStore

        host = bootstrap_address()
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT, multi_tenant=True)
        nonce = secrets.token_bytes(8)
        with _lock:
            _roots[nonce] = store
        return self.unique_id_from_bytes(encode_id(host, store.port, nonce))

    def unique_id_from_bytes(self, data: bytes):
        from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

        if len(data) != 128:
            raise ValueError(f"Expected 128 bytes for ncclUniqueId, got {len(data)} bytes")
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid.internal), data, 128)
        return uid

    def ncclCommInitRank(self, world_size: int, unique_id, rank: int):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        host, port, nonce = decode_id(bytes(unique_id.internal))
        store = _roots.get(nonce) or TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT)
        opts = ProcessGroupGloo._Options()
        opts._timeout = GLOO_TIMEOUT
        opts._devices = [ProcessGroupGloo.create_device(hostname=local_address(host))]
        try:
            pg = ProcessGroupGloo(PrefixStore(f"nccl-standin/{nonce.hex()}/", store), rank, world_size, opts)
        except (RuntimeError, OSError) as e:  # ncclCommInitRank fails when the bootstrap does
            raise NcclStandinError(f"ncclCommInitRank: rendezvous failed ({e})") from None
        comm = Comm(pg, rank, world_size)
        with _lock:
            handle = max(_comms, default=0) + 1
            _comms[handle] = comm
        return ctypes.c_void_p(handle)

    def ncclCommAbort(self, comm) -> None:
        c = _comm(comm, abort=True)
        if os.environ.get("RLSTREAM_STANDIN_DEBUG"):
            import traceback
            print(f"ABORT pid={os.getpid()} handle={comm.value} rank={c.rank}", "".join(traceback.format_stack(limit=12)), flush=True)
        c.aborted.set()
        try:
            c.pg.abort()
        except (RuntimeError, AttributeError):
            pass

    def ncclCommDestroy(self, comm) -> None:
        self.ncclCommAbort(comm)

    def ncclGroupStart(self) -> None:
        pass

    def ncclGroupEnd(self) -> None:
        pass

    # -- collectives (each runs on `stream`, after what is queued there)

    def ncclBroadcast(self, sendbuff, recvbuff, count, datatype, root, comm, stream) -> None:
        c = _comm(comm)
        t = _view(recvbuff, count, datatype)
        if c.rank == root and sendbuff.value not in (None, recvbuff.value):
            t.copy_(_view(sendbuff, count, datatype))
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = int(root), 0
        _on_stream(stream, c, lambda: c.pg.broadcast([t], opts))

    def ncclAllReduce(self, sendbuff, recvbuff, count, datatype, op, comm, stream) -> None:
        from torch.distributed import AllreduceOptions, ReduceOp

        c = _comm(comm)
        t = _view(recvbuff, count, datatype)
        if sendbuff.value != recvbuff.value:
            t.copy_(_view(sendbuff, count, datatype))
        opts = AllreduceOptions()
        opts.reduceOp = getattr(ReduceOp, OPS[int(op)])
        _on_stream(stream, c, lambda: c.pg.allreduce([t], opts))

    def ncclAllGather(self, sendbuff, recvbuff, count, datatype, comm, stream) -> None:
        c = _comm(comm)
        src, out = _view(sendbuff, count, datatype), _view(recvbuff, count * c.world_size, datatype)
        _on_stream(stream, c, lambda: c.pg._allgather_base(out, src))

    def ncclSend(self, sendbuff, count, datatype, dest, comm, stream) -> None:
        c = _comm(comm)
        t = _view(sendbuff, count, datatype)
        _on_stream(stream, c, lambda: c.pg.send([t], int(dest), 0))

    def ncclRecv(self, recvbuff, count, datatype, src, comm, stream) -> None:
        c = _comm(comm)
        t = _view(recvbuff, count, datatype)
        _on_stream(stream, c, lambda: c.pg.recv([t], int(src), 0))


def _comm(handle, abort: bool = False) -> Comm:
    c = _comms.get(int(handle.value or 0))
    if c is None:
        raise NcclStandinError("invalid argument (no such communicator)")
    if c.aborted.is_set() and not abort:
        raise NcclStandinError("invalid usage (the communicator was aborted)")
    return c


def _view(buff, count: int, datatype: int) -> torch.Tensor:
    """The `count` elements at the raw address `buff`, in place (host memory)."""
    dtype = DTYPES[int(datatype)]
    nbytes = int(count) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(int(buff.value))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def _on_stream(stream, c: Comm, start) -> None:
    cuda.stream_of(stream).run(lambda: _complete(c, start))


def _complete(c: Comm, start) -> None:
    """Run one gloo operation to its end, as an NCCL kernel would: a peer's death or
    gloo's own timeout is not an end (NCCL reports neither to the stream); an abort is."""
    if c.aborted.is_set():
        raise NcclStandinError("invalid usage (the communicator was aborted)")
    done = threading.Event()
    failed: list[BaseException] = []
    try:
        work = start()
        fut = work.get_future()
        fut.add_done_callback(lambda f: (failed.extend(_error(f)), done.set()))
    except RuntimeError as e:  # the group broke before the operation started: it waits all the same
        failed.append(e)
    while not (done.is_set() and not failed):
        if c.aborted.wait(POLL_S):
            raise NcclStandinError("remote process exited or there was a network error (communicator aborted)")


def _error(fut) -> list[BaseException]:
    try:
        fut.value()
        return []
    except Exception as e:  # noqa: BLE001 - any failure of gloo's: the operation hangs, as on NCCL
        return [e]


# ---------------------------------------------------------------- the unique id


MAGIC = b"rlstream-nccl-standin\0"


def encode_id(host: str, port: int, nonce: bytes) -> bytes:
    body = MAGIC + nonce + struct.pack("<H", port) + host.encode() + b"\0"
    if len(body) > 128:
        raise ValueError(f"bootstrap host {host!r} does not fit a unique id")
    return body.ljust(128, b"\0")


def decode_id(data: bytes) -> tuple[str, int, bytes]:
    if not data.startswith(MAGIC):
        raise NcclStandinError("invalid argument (not a unique id of the stand-in)")
    rest = data[len(MAGIC):]
    nonce, (port,) = rest[:8], struct.unpack("<H", rest[8:10])
    host = rest[10:].split(b"\0", 1)[0].decode()
    return host, port, nonce


def interfaces() -> dict[str, str]:
    """IPv4 address of each interface that has one (name -> address)."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
    return out


def bootstrap_address() -> str:
    """Where rank 0's bootstrap listens: NCCL_SOCKET_IFNAME's interface, else the first
    non-loopback one, else loopback (a host with no network: every rank is here)."""
    ifs = interfaces()
    wanted = [n for n in os.environ.get("NCCL_SOCKET_IFNAME", "").split(",") if n and not n.startswith("^")]
    for name in wanted:
        if name in ifs:
            return ifs[name]
    return next((a for n, a in ifs.items() if not a.startswith("127.")), "127.0.0.1")


def local_address(peer: str) -> str:
    """This host's address on the route to `peer` (the one gloo's peers can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
