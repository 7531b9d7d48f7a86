"""A synchronous (vLLM `nccl`-style) weight update through the producer's real link and
reloader (producer/weights/trainer_link.py, reload.py) with a fake engine and channel: the
digest the workers fold while loading (common/weights/digest.py, the same function the GPU
path runs, here on CPU tensors) is compared with the trainer's before the version is served;
a refused or failed update restores what was served. The real engine's restore is
tests/integration/test_weight_transfer.py."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rlstream.common import metrics
from rlstream.common.control.messages import WeightsReady
from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.digest import fold_digest
from rlstream.producer.weights.reload import Reloader
from rlstream.producer.weights.trainer_link import NcclLink
from rlstream.producer.weights.worker.verified_update import update_weights_folded
from tests.support.fakes import FakeChannel

SENT = {"model.embed_tokens.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "model.layers.0.mlp.gate.weight": torch.linspace(-1, 1, 10, dtype=torch.bfloat16)}


class FakeNcclEngine:
    """vLLM's nccl engine as rlstream drives it: the update loads into the model at once
    (replacing layers), so a refused update must be restored."""

    weight_transfer = "nccl"
    weight_workers = 1

    def __init__(self, flip_byte: int | None = None, fail: bool = False):
        self.version, self.flip_byte, self.fail = 0, flip_byte, fail
        self.model = "base"
        self.reloads: list[tuple[str, int]] = []

    def _receive(self) -> list[tuple[str, torch.Tensor]]:
        got = [(n, t.clone()) for n, t in SENT.items()]
        if self.flip_byte is not None:  # one byte corrupted in flight
            got[0][1].view(-1).view(torch.uint8)[self.flip_byte] ^= 0x10
        if self.fail:
            self.model = "half-loaded"
            raise KeyError("model.layers.0.mlp.unknown.weight")  # an unknown name, mid-load
        self.model = "loaded"
        return got

    def load_weight_update(self, update_info, timeout_s):  # this branch: loaded, not served
        return fold_digest(self._receive())

    def commit_weights(self, version, t0):
        self.version = version
        return time.perf_counter() - t0

    def run_weight_update(self, update_info, version):  # main's call: loaded and served
        self._receive()
        self.version = version
        return 0.01

    def reload_weights(self, weights_dir, version):
        self.reloads.append((str(weights_dir), version))
        self.model, self.version = "base", version
        return 0.01


def refused() -> float:
    return metrics.value("rlstream_producer_weight_reload_failures_total")


def run_update(engine, tmp_path) -> tuple[Reloader, FakeChannel]:
    """The trainer's update and finish (with the digest it folded while sending), then one tick."""
    reloader = Reloader(engine, tmp_path, "p0", timeout_s=5.0)
    reloader.newest = WeightsReady(version=1, transport="collective", digest="b" * 64, endpoint="trainer:1",
                                   backend="nccl")
    link, channel = NcclLink(engine, "trainer:1", "p0", 5.0), FakeChannel()
    link.channel, reloader.link = channel, link
    channel.post("update", version=1, update_info={"names": list(SENT)})
    channel.post("finish", version=1, digest=fold_digest(SENT.items()))
    reloader.tick()
    return reloader, channel


def test_an_nccl_update_with_the_senders_digest_is_served(tmp_path):
    engine = FakeNcclEngine()
    reloader, channel = run_update(engine, tmp_path)
    assert engine.version == 1 and engine.model == "loaded" and engine.reloads == []
    assert reloader.state()["state"] == "serving" and reloader.state()["serving_version"] == 1
    assert channel.acks[1] == {"version": 1, "digest": fold_digest(SENT.items())}


@pytest.mark.parametrize("byte", [0, 37, 95])
def test_an_nccl_update_with_one_flipped_byte_is_refused_and_the_served_weights_restored(tmp_path, byte):
    before = refused()
    engine = FakeNcclEngine(flip_byte=byte)
    reloader, channel = run_update(engine, tmp_path)
    assert engine.version == 0, "a version with a corrupted byte was served"
    assert engine.model == "base" and engine.reloads == [(str(tmp_path), 0)]
    assert "digest" in channel.acks[1]["error"] and refused() == before + 1
    state = reloader.state()  # what /healthz shows
    assert state["state"] == "failed" and state["serving_version"] == 0 and "digest" in state["failure"]["reason"]


def test_an_nccl_update_failing_while_loading_restores_the_served_weights(tmp_path):
    engine = FakeNcclEngine(fail=True)
    _, channel = run_update(engine, tmp_path)
    assert engine.version == 0 and engine.model == "base" and engine.reloads == [(str(tmp_path), 0)]
    assert "unknown" in channel.acks[0]["error"]


def test_an_nccl_update_whose_finish_never_comes_is_restored_within_the_timeout(tmp_path):
    engine = FakeNcclEngine()
    reloader = Reloader(engine, tmp_path, "p0", timeout_s=0.2)
    reloader.newest = WeightsReady(version=1, transport="collective", digest="b" * 64, endpoint="trainer:1",
                                   backend="nccl")
    link, channel = NcclLink(engine, "trainer:1", "p0", 0.2), FakeChannel()
    link.channel, reloader.link = channel, link
    channel.post("update", version=1, update_info={"names": list(SENT)})  # the trainer died after it
    t0 = time.monotonic()
    reloader.tick()
    assert time.monotonic() - t0 < 0.2 + 2.0  # the bound, plus a margin for a loaded machine
    assert engine.version == 0 and engine.model == "base" and link.dead


# ---------------------------------------------------------------- in the worker


@pytest.fixture
def nccl_pair():
    """Two ranks of vLLM's PyNcclCommunicator (its own Python: rendezvous, unique id, warm-up),
    over the CPU stand-in of libnccl (common/gpu_standin/): rank 0 is the trainer, rank 1 the worker."""
    from rlstream.common import gpu_standin
    from rlstream.common.kafka.broker import free_port

    with gpu_standin.installed():
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        port, comms = free_port(), [None, None]

        def join(rank):  # each rank a device of its own: its own stream (one process: a stream per thread)
            torch.cuda.set_stream(torch.cuda.Stream())
            comms[rank] = stateless_init_process_group("127.0.0.1", port, rank, 2, "cpu")
        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        yield comms
        for c in comms:
            c.destroy()


class FakeModel:
    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.loaded[name] = t.clone()


class Worker:
    """vLLM's Worker and its nccl engine, the model light: `update_weights` receives each tensor
    of SENT over the communicator (PyNccl's broadcast from rank 0) and loads it."""

    def __init__(self, group):
        self.weight_transfer_engine = SimpleNamespace(model=FakeModel(), model_update_group=group)
        self.calls = []

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        model, group = self.weight_transfer_engine.model, self.weight_transfer_engine.model_update_group
        for name, t in SENT.items():
            buf = torch.empty_like(t)
            group.broadcast(buf, src=0)
            model.load_weights([(name, buf)])

    def finish_weight_update(self):
        self.calls.append("finish")


def trainer_sends(group, n: int) -> threading.Thread:
    """The trainer: broadcasts the first `n` tensors of SENT, then dies (sends nothing more)."""
    def run():
        torch.cuda.set_stream(torch.cuda.Stream())  # the trainer's device, not the worker's
        for t in list(SENT.values())[:n]:
            group.broadcast(t.clone(), src=0)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_worker_folds_exactly_what_it_loads(nccl_pair):
    trainer, group = nccl_pair
    worker = Worker(group)
    trainer_sends(trainer, len(SENT))
    got = update_weights_folded(worker, {}, timeout_s=30.0)
    assert got == fold_digest(SENT.items()) and worker.calls == ["start", "update", "finish"]
    assert all(torch.equal(worker.weight_transfer_engine.model.loaded[n], t) for n, t in SENT.items())
    assert "load_weights" not in vars(worker.weight_transfer_engine.model)  # the class's method is back


def test_a_trainer_dying_mid_transfer_ends_the_workers_wait_within_the_bound(nccl_pair):
    """PyNccl has no timeout: the worker's receive blocks until the watchdog aborts the
    communicator, which is disabled from then on (PyNccl's own check: later calls are no-ops)."""
    trainer, group = nccl_pair
    worker = Worker(group)
    trainer_sends(trainer, 1)
    t0 = time.monotonic()
    with pytest.raises(WeightTransferError, match="no progress"):
        update_weights_folded(worker, {}, timeout_s=0.5)
    assert time.monotonic() - t0 < 0.5 + 3.0  # the bound, plus a margin for a loaded machine
    assert group.disabled
    group.broadcast(torch.zeros(4), src=0)  # returns at once: nothing is left to block on


def test_a_trainer_that_aborts_mid_transfer_ends_the_workers_wait_at_once(nccl_pair):
    """The trainer gave up (its own watchdog aborted its communicator, or it died): the worker's
    receive never returns (NCCL), but NCCL reports the lost connection as an asynchronous error,
    which the watchdog polls: the wait ends within about a second, not at the 30 s bound."""
    from rlstream.common.weights.watchdog import abort_nccl

    trainer, group = nccl_pair
    worker = Worker(group)
    trainer_sends(trainer, 1).join(30)
    threading.Timer(0.5, abort_nccl, args=(trainer,)).start()
    t0 = time.monotonic()
    with pytest.raises(WeightTransferError, match="reported an error"):
        update_weights_folded(worker, {}, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0  # far inside the bound, with a margin for a loaded machine
    assert group.disabled


def test_a_link_whose_update_was_aborted_is_dead(nccl_pair):
    """After the abort the communicator is disabled: an update over it would "receive" at
    once and load empty buffers. The link is marked dead, so the reloader registers anew."""
    trainer, group = nccl_pair
    worker = Worker(group)

    class Engine(FakeNcclEngine):
        def load_weight_update(self, update_info, timeout_s):
            return update_weights_folded(worker, update_info, timeout_s)
    link, channel = NcclLink(Engine(), "trainer:1", "p0", 0.5), FakeChannel()
    link.channel = channel
    trainer_sends(trainer, 1)
    channel.post("update", version=1, update_info={"names": list(SENT)})
    link.poll()
    assert link.dead and "no progress" in link.dead
    assert "no progress" in channel.acks[0]["error"] and link.take_update().error


# ---------------------------------------------------------------- the trainer's half


def test_the_trainers_finish_carries_the_digest_of_what_it_sent_in_the_order_the_producer_loads_it():
    """consumer/weights/nccl.py: SnapshotSource folds each tensor as it goes to the device
    (here "cpu") and LinkClient's finish carries it; it equals what a worker folds from the same
    tensors in the metadata order vLLM's nccl engine receives them in."""
    from rlstream.consumer.weights.client import LinkClient
    from rlstream.consumer.weights.nccl import SnapshotSource
    from rlstream.consumer.weights.snapshot import Snapshot
    from tests.support.weights import dict_source

    snap = Snapshot(1, dict_source(dict(SENT)))
    snap.fill()
    source = SnapshotSource(snap, device="cpu")
    sent = list(source)
    client = object.__new__(LinkClient)
    client.version, client.timeout_s, client.fold = 1, 1.0, source.fold_digest
    client.channel = SimpleNamespace(call=lambda op, timeout_s, **args: {"op": op, **args})
    finish = client.finish_weight_update()
    assert [m.name for m in source.metadata()] == [n for n, _ in sent]
    assert finish == {"op": "finish", "version": 1, "digest": fold_digest(SENT.items())}


def test_after_acknowledging_an_nccl_start_the_producer_waits_for_the_update_without_stepping():
    """Every member of a group acknowledges `start` before the trainer posts `update` and enters the
    broadcast. A member that went back to its engine loop in between (a step, a durable load of
    minutes) would be late for the collective and hold the others in their receive until their
    watchdogs fire: once it acknowledged `start`, poll runs the update that follows before returning."""
    class Engine(FakeNcclEngine):
        loaded = 0

        def load_weight_update(self, update_info, timeout_s):
            Engine.loaded += 1
            return super().load_weight_update(update_info, timeout_s)
    link, channel = NcclLink(Engine(), "trainer:1", "p0", 10.0), FakeChannel()
    link.channel = channel
    channel.post("start", version=1)
    threading.Timer(0.3, lambda: channel.post("update", version=1, update_info={"names": list(SENT)})).start()
    link.poll()  # returns only after the update
    assert channel.acks[0] == {} and Engine.loaded == 1 and link.update is not None and link.update.version == 1


def test_an_nccl_start_without_its_update_marks_the_link_dead():
    link, channel = NcclLink(FakeNcclEngine(), "trainer:1", "p0", 0.3), FakeChannel()
    link.channel = channel
    channel.post("start", version=1)  # the trainer died before its update
    link.poll()
    assert link.dead and "no update" in link.dead
