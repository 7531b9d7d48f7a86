"""Weight versions for the collective-path tests: HF tensors, as a vLLM WeightSource, on disk.

    base = read_weights(model_dir)
    w1 = perturbed(base, seed=1)                     # another version of the same model
    big = random_version(1, 6, 1 << 20)              # a version of no model: 6 tensors of 1 MiB
    source = DictSource(w1)                          # what a trainer would stream
    d = write_version(tmp / "w1", w1, model_dir)     # the same version as an HF directory (file path)
    with corrupting(on=True): sender.publish(snap)   # the benches' tamper round: one byte flipped on the wire
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch


def read_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def perturbed(base: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous() for k, v in base.items()}


def random_version(seed: int, groups: int, group_bytes: int) -> dict[str, torch.Tensor]:
    """A version of no model: `groups` float32 tensors of `group_bytes` each, random from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(group_bytes // 4, generator=g) for i in range(groups)}


def write_version(dst: Path, tensors: dict[str, torch.Tensor], model_dir) -> Path:
    """An HF directory of `tensors` beside the model's config and tokenizer."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def dict_source(tensors: dict[str, torch.Tensor]):
    """A vLLM WeightSource over an HF dict: groups are vLLM's `layerwise_groups` of its names."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            yield from tensors.items()

    return DictSource()


class corrupting:
    """Flip one byte of the second group buffer each sending thread puts on the wire, after its
    digest was taken (the tamper round of tests/bench/weights.py and tests/bench/_fanout_twin.py).
    `thread`: only that thread's sends, e.g. the fan-out group's ("rlstream-weights-fanout"), so
    the copies re-sent over the producers' own links afterwards go out intact."""

    def __init__(self, on: bool, thread: str | None = None, transport: str = "gloo"):
        self.on, self.thread, self.sent, self.transport = on, thread, {}, transport

    def __enter__(self):
        from rlstream.common.gpu_standin.ring import Ring
        from rlstream.common.weights.chain import ChainLink
        from rlstream.common.weights.link import GlooPair

        # the wire: gloo's pairs (a link's own, the fan-out group's), or the NCCL stand-in's sockets
        classes = (Ring,) if self.transport == "nccl-standin" else (GlooPair, ChainLink)
        self.saved = [(cls, cls.send if cls is not Ring else cls._send) for cls in classes]
        if self.on:
            for cls, orig in self.saved:
                if cls is Ring:
                    cls._send = self._flipping_bytes(orig)
                else:
                    cls.send = self._flipping(orig)
        return self

    def _flipping_bytes(self, orig):
        def send(ring, peer, buf):
            me = threading.current_thread().name
            if len(buf) > 1024 and self.thread in (None, me):  # a chunk of the packed version
                self.sent[me] = self.sent.get(me, 0) + 1
                if self.sent[me] == 2:
                    b = bytearray(buf)
                    b[len(b) // 2] ^= 0xFF
                    buf = memoryview(b)
            return orig(ring, peer, buf)
        return send

    def _flipping(self, orig):
        def send(pair, t):
            me = threading.current_thread().name  # one thread per link, one for the group
            if t.numel() > 1024 and self.thread in (None, me):  # a group buffer (headers and digests are smaller)
                self.sent[me] = self.sent.get(me, 0) + 1
                if self.sent[me] == 2:
                    t = t.clone()
                    t.view(-1).view(torch.uint8)[t.numel() // 2] ^= 0xFF
            return orig(pair, t)
        return send

    def __exit__(self, *exc):
        from rlstream.common.gpu_standin.ring import Ring

        for cls, orig in self.saved:
            setattr(cls, "_send" if cls is Ring else "send", orig)



def wait_for(what: str, cond, timeout_s: float) -> float:
    """Poll `cond` until true; fail naming `what` after `timeout_s`. Returns the seconds waited."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


class LinkedProducer:
    """A producer's engine (WorkerProcesses) and its real link (TrainerLink), ticked between
    (absent) engine steps by a thread of its own (`poll_in_thread`), as each producer's loop is
    its own: a group's init blocks every member in the rendezvous until all of them join.
    A tick does what producer/weights/reload.py does with the link: a settled version is
    served if its digest is the trainer's (`held`; there is no model to load it into), else
    refused, and the trainer's finish answered; a dead link is registered anew."""

    held: tuple[int, str] | None = None
    """(version, digest) of the last version served."""

    def __init__(self, name: str, engine: "WorkerProcesses", endpoint: str, timeout_s: float):
        self.name, self.engine, self.endpoint, self.timeout_s = name, engine, endpoint, timeout_s
        self.lock = threading.Lock()
        self.registrations = 0
        self.link = None
        self.gone = False

    def connect(self) -> None:
        from rlstream.producer.weights.trainer_link import TrainerLink

        self.link = TrainerLink.connect(self.engine, self.endpoint, self.name, self.timeout_s)
        self.registrations += 1

    def tick(self) -> None:
        with self.lock:
            self.link.poll()
            if (u := self.link.take_update()) is not None:
                why = u.error or (None if u.received == u.expected else
                                  f"received digest {u.received}, sent {u.expected}")
                self.link.answer_update(u, why)
                if why is None:
                    self.held = (u.version, u.received)  # gloo: its staging stays for `received`
                elif u.staged:
                    self.engine.discard_weights()
            if self.link.dead:
                self.connect()

    def holds(self, version: int, digest: str | None = None) -> bool:
        return self.held is not None and self.held[0] == version and digest in (None, self.held[1])

    def received(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return self.engine.received()[0]

    def poll_in_thread(self, stop: threading.Event) -> threading.Thread:
        def run() -> None:
            while not stop.is_set() and not self.gone:
                self.tick()
                time.sleep(0.01)
        t = threading.Thread(target=run, daemon=True, name=f"poll-{self.name}")
        t.start()
        return t


class TrainerSide:
    """The trainer's sending half (consumer/weights/sender.py, consumer/weights/gloo.py, consumer/weights/durable.py),
    fed versions by the test instead of a training loop.

        trainer = TrainerSide(tmp / "store", model_dir)
        msg = trainer.publish(1, tensors, durable=True)   # WeightsReady(transport=collective, ...)
    """

    def __init__(self, store_dir: Path, model_dir, timeout_s: float = 20.0, writer=None,
                 backend: str = "rlstream_gloo"):
        from rlstream.common.config import WeightSyncSettings
        from rlstream.common.weights.store import WeightStore
        from rlstream.consumer.weights.sender import WeightSender

        self.sender = WeightSender(WeightSyncSettings(timeout_s=timeout_s), backend=backend)
        self.store = WeightStore(store_dir, keep=20)
        self.model_dir, self.writer = model_dir, writer
        self.snapshot = None
        self.durable = None

    def publish(self, version: int, tensors: dict, durable: bool = False, snapshot_cls=None):
        """Stream `tensors` as `version` to every link; announce it (through `writer` when set)."""
        from rlstream.common.control.messages import DurableCopy, WeightsReady
        from rlstream.consumer.weights.snapshot import Snapshot

        snap = (snapshot_cls or Snapshot)(version, dict_source(tensors), reuse=self.snapshot)
        self.sender.publish(snap)
        snap.fill()
        self.snapshot = snap
        if durable:
            m = self.store.write(version, tensors, self.model_dir)
            self.durable = DurableCopy(version, m["uri"], m["sha256"], m["bytes"])
        d = self.durable
        extra = {} if d is None else dict(durable_version=d.version, durable_uri=d.uri, durable_sha256=d.sha256,
                                          durable_bytes=d.bytes)
        msg = WeightsReady(version=version, transport="collective", digest=snap.digest,
                           endpoint=self.sender.endpoint, backend=self.sender.backend, **extra)
        if self.writer is not None:
            self.writer.announce(msg)
        return msg

    def close(self) -> None:
        self.sender.close()


# ---------------------------------------------------------------- a producer of several workers


class WorkerProcesses:
    """A producer engine of `n` workers (tensor_parallel_size n) as the trainer link sees it,
    without a model: each worker is a process running the real receiving engine, driven
    like vLLM's `collective_rpc` (every worker runs each call; the engine's status
    combines theirs).
    - `rlstream_gloo`: producer/weights/worker/gloo_engine.py RlstreamGlooEngine (its rank from the
      init info, the gloo group, the background receive and its digests);
    - `nccl`: vLLM's own NCCLWeightTransferEngine over the CPU stand-ins (common/gpu_standin/):
      vLLM parses the init payload, joins the group at the worker's rank offset and runs its
      packed receive; the update is rlstream's folded update (producer/weights/worker/verified_update.py)
      under its watchdog. Only the model is light: it keeps what it is given to load.

        with WorkerProcesses(2) as engine:
            link = TrainerLink.connect(engine, endpoint, "p0", timeout_s)
    """

    def __init__(self, n: int, timeout_s: float = 60.0, backend: str = "rlstream_gloo", device_base: int = 1):
        import multiprocessing as mp

        # spawn, not fork: libgomp is not fork-safe. After earlier tests of the session started
        # an OpenMP team (vLLM's CPU worker binds threads and then refuses torch.set_num_threads),
        # a forked worker hung or segfaulted in gomp_team_start at its first parallel copy.
        ctx = mp.get_context("spawn")
        self.weight_workers, self.timeout_s, self.weight_transfer = n, timeout_s, backend
        self._conns, self._procs = [], []
        main = _nccl_worker_main if backend == "nccl" else _worker_main
        for rank in range(n):
            parent, child = ctx.Pipe()
            args = (child, rank, n, device_base) if backend == "nccl" else (child, rank, n)
            p = ctx.Process(target=main, args=args, daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)

    def _rpc(self, op: str, wait_s: float | None = None, **kw) -> list:
        """Every worker runs `op`; their answers. Calls are numbered: an answer that comes
        after its call timed out is dropped, never taken for the next call's."""
        self._seq = getattr(self, "_seq", 0) + 1
        for c in self._conns:
            c.send((self._seq, op, kw))
        return [self._answer(c, op, wait_s or self.timeout_s) for c in self._conns]

    def _answer(self, c, op: str, wait_s: float):
        deadline = time.monotonic() + wait_s
        while c.poll(max(0.0, deadline - time.monotonic())):
            seq, ok, value = c.recv()
            if seq != self._seq:
                continue
            if not ok:
                from rlstream.common.errors import WeightTransferError

                raise WeightTransferError(value)
            return value
        raise TimeoutError(f"worker did not answer {op!r} within {wait_s} s")

    # what producer/weights/trainer_link.py calls on producer.engine.RolloutEngine
    def init_weight_link(self, init_info: dict) -> None:
        self._rpc("init", init_info=init_info)

    def receive_weights(self) -> None:
        self._rpc("receive")

    def weight_status(self) -> dict:
        from rlstream.producer.weights.worker.gloo_engine import combine_worker_status

        return combine_worker_status(self._rpc("status"))

    def discard_weights(self) -> None:
        self._rpc("discard")

    def load_weight_update(self, update_info: dict, timeout_s: float) -> str:
        """nccl: receive and load now, as producer.engine.RolloutEngine does (the workers must agree)."""
        from rlstream.common.errors import WeightTransferError

        digests = self._rpc("update", update_info=update_info, timeout_s=timeout_s)
        if len(set(digests)) != 1:
            raise WeightTransferError(f"the engine's workers received different bytes: {sorted(set(digests))}")
        return digests[0]

    def close_weight_link(self) -> None:
        self._rpc("shutdown")

    def ready(self, timeout_s: float = 600.0) -> None:
        """Every worker has started (spawned: each imports vLLM first, 10-60 s on a busy machine)."""
        self._rpc("ready" if self.weight_transfer == "nccl" else "status", wait_s=timeout_s)

    def received(self) -> list[dict[str, torch.Tensor]]:
        """Each worker's received tensors (clones)."""
        return self._rpc("tensors")

    def kill(self) -> None:
        """SIGKILL every worker (a producer that dies mid-version: its sockets close)."""
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(timeout=10)

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send((-1, "close", {}))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(conn, rank: int, calls: dict) -> None:
    """A worker's RPC loop: run each numbered call the parent sends, answer (number, ok, value)."""
    while True:
        seq, op, kw = conn.recv()
        try:
            conn.send((seq, True, calls[op](**kw)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, as collective_rpc does
            conn.send((seq, False, f"worker {rank}: {e}"))
        if op == "close":
            return


class _KeepingModel(torch.nn.Module):
    """A model that keeps what it is given to load (clones: the packed buffers are reused)."""

    def __init__(self):
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.received[name] = t.to("cpu", copy=True)
        return set()


class _LightWorker:
    """vLLM's Worker weight-update calls on `engine`, without a model runner: start, update
    and finish go to the engine as the Worker's do, less its layerwise reload of a real model."""

    def __init__(self, engine):
        self.weight_transfer_engine = engine

    def start_weight_update(self) -> None:
        self.weight_transfer_engine.model.received.clear()

    def update_weights(self, update_info: dict) -> None:
        self.weight_transfer_engine.update_weights(update_info)  # vLLM's parse + packed receive

    def finish_weight_update(self) -> None:
        pass


def _nccl_worker_main(conn, rank: int, n: int, device_base: int = 1) -> None:
    """One worker: vLLM's NCCLWeightTransferEngine (TP n, this rank), over the CPU stand-ins, or
    on a GPU machine on CUDA device `device_base + rank` (the trainer holds device 0)."""
    import os
    from types import SimpleNamespace

    torch.set_num_threads(1)
    from rlstream.common import gpu_standin

    if torch.cuda.is_available():
        torch.cuda.set_device(device_base + rank)
        device = torch.device("cuda", device_base + rank)
    else:
        os.environ[gpu_standin.ENV] = "1"
        gpu_standin.install()
        device = torch.device("cpu")
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    # what the receive imports, imported now as a vLLM worker has (it loaded a model at start)
    from vllm.model_executor.model_loader import mtp_validation  # noqa: F401

    from rlstream.producer.weights.worker.verified_update import update_weights_folded

    parallel = SimpleNamespace(world_size=n, rank=rank, data_parallel_index=0)
    engine = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"),
                                      SimpleNamespace(parallel_config=parallel, model_config=None),
                                      device, _KeepingModel())
    worker = _LightWorker(engine)
    _serve(conn, rank, {
        "init": lambda init_info: engine.init_transfer_engine(engine.parse_init_info(init_info)),
        "update": lambda update_info, timeout_s: update_weights_folded(worker, update_info, timeout_s),
        "shutdown": engine.shutdown,
        "tensors": lambda: dict(engine.model.received),
        "ready": lambda: True,
        "close": engine.shutdown,
    })


def _worker_main(conn, rank: int, n: int) -> None:
    """One worker: the real RlstreamGlooEngine on a stub vLLM config (TP n, this rank)."""
    from types import SimpleNamespace

    torch.set_num_threads(1)  # two workers and the trainer share the machine's cores

    from rlstream.producer.weights.worker.gloo_engine import RlstreamGlooEngine, RlstreamGlooUpdateInfo

    parallel = SimpleNamespace(world_size=n, rank=rank, data_parallel_index=0)
    engine = RlstreamGlooEngine(None, SimpleNamespace(parallel_config=parallel, model_config=None), "cpu",
                                torch.nn.Module())
    _serve(conn, rank, {
        "init": lambda init_info: engine.init_transfer_engine(engine.parse_init_info(init_info)),
        "receive": lambda: engine.receive_weights(RlstreamGlooUpdateInfo(op="receive")),
        "discard": lambda: engine.receive_weights(RlstreamGlooUpdateInfo(op="discard")),
        "status": engine.status,
        "tensors": lambda: {name: t.clone() for name, t in engine._staged.tensors()},
        "close": engine.shutdown,
    })
