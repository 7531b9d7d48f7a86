"""`NCCLLibrary` (vLLM's ctypes binding of libnccl) for CPU processes.

    lib = StandinNccl()                         # what vLLM's PyNcclCommunicator gets
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
  waits until the communicator is aborted. Here a peer's closed connection does not end
  the operation either: it waits for `ncclCommAbort`.
- **Abort ends it.** `ncclCommAbort` releases every operation blocked in the
  communicator with an NCCL error; any later call on it fails ("invalid usage").
- **A lost peer shows as an asynchronous error.** `ncclCommGetAsyncError` (the CDLL
  symbol, `lib`) reports ncclRemoteError once a peer's connection was lost, as NCCL's
  network transports do; nothing tells the waiting operation.

What it does not model: bandwidth, the GPU's own memory, and NCCL's shared-memory and
NVLink transports (which do not detect a lost peer: only the watchdog's bound ends those). The unique id carries `host:port` of a
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

from rlstream.common.gpu_standin import cuda
from rlstream.common.gpu_standin.ring import PeerLost, Ring

VERSION = 22805
"""The NCCL version reported (2.28.5: the nvidia-nccl-cu13 torch 2.13 pins)."""
STORE_TIMEOUT = timedelta(seconds=300)
"""The bootstrap's rendezvous bound (NCCL's own bootstrap waits about as long)."""

DTYPES = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 3: torch.int32, 4: torch.int64, 5: torch.int64,
          6: torch.float16, 7: torch.float32, 8: torch.float64, 9: torch.bfloat16, 10: torch.float8_e4m3fn}
"""ncclDataType_t -> a torch dtype of the same width (unsigned ones as their signed twin:
broadcast, send and receive move bytes; sums of unsigned ints are not used here)."""
REDUCE = {0: torch.add, 1: torch.mul, 2: torch.maximum, 3: torch.minimum, 4: torch.add}
"""ncclRedOp_t -> how two contributions combine (4, avg: summed, then divided)."""


class NcclStandinError(RuntimeError):
    """What vLLM's NCCL_CHECK raises for an NCCL error code."""

    def __init__(self, what: str):
        super().__init__(f"NCCL error: {what}")


@dataclass
class Comm:
    """One communicator: its ranks' connections (ring.py), one operation at a time."""

    ring: Ring
    aborted: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    async_error: int = 0
    """What ncclCommGetAsyncError reports: ncclRemoteError (6) once a peer's connection was lost."""

    @property
    def rank(self) -> int:
        return self.ring.rank

    @property
    def world_size(self) -> int:
        return self.ring.world_size


_comms: dict[int, Comm] = {}
_roots: dict[bytes, object] = {}  # rank 0's bootstrap stores, kept alive for the group's life
_lock = threading.Lock()


REMOTE_ERROR = 6
"""ncclRemoteError: NCCL's asynchronous error when a peer's connection is lost."""


class _Symbols:
    """`NCCLLibrary.lib` (the CDLL): the symbols rlstream calls beyond vLLM's binding."""

    @staticmethod
    def ncclCommGetAsyncError(comm, result) -> int:
        c = _comms.get(int(getattr(comm, "value", comm) or 0))
        if c is None:
            return 4  # ncclInvalidArgument
        result._obj.value = c.async_error
        return 0


class StandinNccl:
    """The methods of vLLM's `NCCLLibrary` that its communicators call."""

    lib = _Symbols()

    def __init__(self, so_file: str | None = None):
        self.so_file = so_file

    def has_symbol(self, name: str) -> bool:
        return name in ("ncclCommAbort", "ncclCommDestroy", "ncclGroupStart", "ncclGroupEnd")

    def ncclGetErrorString(self, result: int) -> str:
        return f"stand-in error {result}"

    def ncclGetRawVersion(self) -> int:
        return VERSION

    def ncclGetVersion(self) -> str:
        return "2.28.5 (CPU stand-in)"

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
        from torch.distributed import PrefixStore, TCPStore

        host, port, nonce = decode_id(bytes(unique_id.internal))
        try:  # a connection of this rank's own: ranks may share a process (threads of a test)
            store = PrefixStore(f"nccl-standin/{nonce.hex()}/", TCPStore(host, port, is_master=False,
                                                                          timeout=STORE_TIMEOUT))
            ring = Ring.open(store, rank, world_size, local_address(host), STORE_TIMEOUT)
        except (RuntimeError, OSError) as e:  # ncclCommInitRank fails when the bootstrap does
            raise NcclStandinError(f"ncclCommInitRank: bootstrap failed ({e})") from None
        with _lock:
            handle = max(_comms, default=0) + 1
            _comms[handle] = Comm(ring)
        return ctypes.c_void_p(handle)

    def ncclCommAbort(self, comm) -> None:
        c = _comm(comm, abort=True)
        c.aborted.set()
        c.ring.close()

    def ncclCommDestroy(self, comm) -> None:
        self.ncclCommAbort(comm)

    def ncclGroupStart(self) -> None:
        pass

    def ncclGroupEnd(self) -> None:
        pass

    # -- collectives (each runs on `stream`, after what is queued there)

    def ncclBroadcast(self, sendbuff, recvbuff, count, datatype, root, comm, stream) -> None:
        c = _comm(comm)
        buf = _bytes(recvbuff, count, datatype)
        if c.rank == root and sendbuff.value not in (None, recvbuff.value):
            buf[:] = _bytes(sendbuff, count, datatype)
        _on_stream(stream, c, lambda: c.ring.broadcast(buf, int(root)))

    def ncclAllReduce(self, sendbuff, recvbuff, count, datatype, op, comm, stream) -> None:
        c = _comm(comm)
        out = _view(recvbuff, count, datatype)
        if sendbuff.value != recvbuff.value:
            out.copy_(_view(sendbuff, count, datatype))
        _on_stream(stream, c, lambda: _all_reduce(c.ring, out, int(op)))

    def ncclAllGather(self, sendbuff, recvbuff, count, datatype, comm, stream) -> None:
        c = _comm(comm)
        width = int(count) * DTYPES[int(datatype)].itemsize
        out = _bytes(recvbuff, int(count) * c.world_size, datatype)
        out[c.rank * width:(c.rank + 1) * width] = _bytes(sendbuff, count, datatype)
        _on_stream(stream, c, lambda: [c.ring.broadcast(out[r * width:(r + 1) * width], r)
                                       for r in range(c.world_size)])

    def ncclSend(self, sendbuff, count, datatype, dest, comm, stream) -> None:
        c = _comm(comm)
        buf = _bytes(sendbuff, count, datatype)
        _on_stream(stream, c, lambda: c.ring.send(buf, int(dest)))

    def ncclRecv(self, recvbuff, count, datatype, src, comm, stream) -> None:
        c = _comm(comm)
        buf = _bytes(recvbuff, count, datatype)
        _on_stream(stream, c, lambda: c.ring.recv(buf, int(src)))


def _all_reduce(ring: Ring, out: torch.Tensor, op: int) -> None:
    """Rank 0 combines every rank's contribution, then the result goes round the ring."""
    raw = memoryview(out.view(torch.uint8).numpy())
    if ring.rank == 0:
        part = torch.empty_like(out)
        for r in range(1, ring.world_size):
            ring.recv(memoryview(part.view(torch.uint8).numpy()), r)
            out.copy_(REDUCE[op](out, part))
        if op == 4:
            out.div_(ring.world_size)
    else:
        ring.send(raw, 0)
    ring.broadcast(raw, 0)


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


def _bytes(buff, count: int, datatype: int) -> memoryview:
    nbytes = int(count) * DTYPES[int(datatype)].itemsize
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(int(buff.value))).cast("B")


def _on_stream(stream, c: Comm, op) -> None:
    cuda.stream_of(stream).run(lambda: _complete(c, op))


def _complete(c: Comm, op) -> None:
    """Run one operation to its end, as an NCCL kernel would: a peer's death is not an end
    (NCCL reports it to nobody who waits on the stream): it waits for an abort, which is."""
    if c.aborted.is_set():
        raise NcclStandinError("invalid usage (the communicator was aborted)")
    with c.lock:
        try:
            op()
            return
        except PeerLost:
            c.async_error = REMOTE_ERROR  # reported to whoever polls ncclCommGetAsyncError, not to the stream
    c.aborted.wait()
    raise NcclStandinError("remote process exited or there was a network error (communicator aborted)")


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
    """This host's address on the route to `peer` (the one the other ranks can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
