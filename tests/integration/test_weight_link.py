"""The collective path's transport without a vLLM engine (common/weights/link.py, consumer/weights/gloo.py
Snapshot): real gloo pairs over loopback, one thread per end; and a producer of two workers
(tensor_parallel_size 2), each a process running the real receiving engine, behind the real
trainer (WeightSender) and the real producer link (TrainerLink)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rlstream.common.errors import DigestMismatchError, WeightTransferError
from rlstream.common.weights import link, wire
from tests.support.weights import TrainerSide, WorkerProcesses, dict_source


def groups_of(n: int, size: int = 1 << 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"model.layers.{i}.w": torch.randn(size, generator=g) for i in range(n)}


class Pair:
    """Both ends of one link in this process: `trainer` (rank 0) and `producer` (rank 1)."""

    def __init__(self, timeout_s: float = 10.0):
        self.store = link.open_store("127.0.0.1", 0, timeout_s, master=True)
        n = link.register(link.open_store("127.0.0.1", self.store.port, timeout_s), "p0")
        ends = {}

        def producer():
            ends["producer"] = link.GlooPair.open(link.open_store("127.0.0.1", self.store.port, timeout_s), n, 1,
                                                  timeout_s)

        t = threading.Thread(target=producer)
        t.start()
        self.trainer = link.GlooPair.open(self.store, n, 0, timeout_s)
        t.join()
        self.producer = ends["producer"]


def receive_in_thread(pair: link.GlooPair, **kw):
    out = {}

    def run():
        try:
            out["version"] = link.receive_version(pair, **kw)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out


def packed(tensors: dict) -> tuple[wire.VersionHeader, list[torch.Tensor]]:
    specs = [wire.GroupSpec.of([n], [t.dtype], [tuple(t.shape)]) for n, t in tensors.items()]
    return wire.VersionHeader(1, specs), [wire.pack([t]) for t in tensors.values()]


def test_a_version_arrives_exactly_and_a_reused_pool_receives_the_next():
    pair, ts = Pair(), groups_of(3)
    header, bufs = packed(ts)
    t, out = receive_in_thread(pair.producer)
    vd = link.send_version(pair.trainer, header, iter([(b, lambda b=b: wire.digest(b)) for b in bufs]))
    t.join(10)
    got = out["version"]
    assert got.digest == vd.hex() and dict(got.tensors()).keys() == ts.keys()
    assert all(torch.equal(dict(got.tensors())[k], v) for k, v in ts.items())
    ptrs = {b.data_ptr() for b in got.buffers}
    t, out = receive_in_thread(pair.producer, pool=got.buffers)
    link.send_version(pair.trainer, header, iter([(b, lambda b=b: wire.digest(b)) for b in bufs]))
    t.join(10)
    assert {b.data_ptr() for b in out["version"].buffers} == ptrs  # warm buffers, no fresh allocation


def test_a_bucket_corrupted_in_flight_is_refused_after_the_whole_stream_and_the_link_stays_usable():
    pair, ts = Pair(), groups_of(3)
    header, bufs = packed(ts)
    t, out = receive_in_thread(pair.producer)

    def corrupted():
        for g, b in enumerate(bufs):
            d = wire.digest(b)
            if g == 1:  # flipped after hashing: on the wire only
                b = b.clone()
                b[b.numel() // 2] ^= 0xFF
            yield b, (lambda d=d: d)
    link.send_version(pair.trainer, header, corrupted())
    t.join(10)
    assert isinstance(out["error"], DigestMismatchError) and "group 1" in str(out["error"])
    t, out = receive_in_thread(pair.producer)  # aligned: the next version goes through
    link.send_version(pair.trainer, header, iter([(b, lambda b=b: wire.digest(b)) for b in bufs]))
    t.join(10)
    assert "version" in out


def test_a_receiver_that_goes_away_fails_the_send_within_the_timeout():
    pair, ts = Pair(timeout_s=3.0), groups_of(2, size=1 << 20)
    header, bufs = packed(ts)
    pair.producer.close()  # the producer died: its end of the pair is gone
    t0 = time.monotonic()
    with pytest.raises(WeightTransferError, match="weight link"):
        link.send_version(pair.trainer, header, iter([(b, lambda b=b: wire.digest(b)) for b in bufs]))
    assert time.monotonic() - t0 < 3.0 + 2.0


def test_a_snapshot_streams_groups_while_it_is_still_filling():
    from rlstream.consumer.weights.snapshot import Snapshot

    ts = groups_of(4)
    slow = dict_source(ts)
    inner = slow.iter_groups
    filled_at: list[float] = []

    def iter_groups():  # an export that takes 0.2 s per layer group
        for item in inner():
            time.sleep(0.2)
            filled_at.append(time.monotonic())
            yield item
    slow.iter_groups = iter_groups
    snap = Snapshot(3, slow)
    pair = Pair()
    first_group_at = []
    t, out = receive_in_thread(pair.producer)

    def send():
        def groups():
            for g, (buf, dg) in enumerate(snap.groups()):
                if g == 0:
                    first_group_at.append(time.monotonic())
                yield buf, dg
        link.send_version(pair.trainer, snap.header, groups())
    s = threading.Thread(target=send)
    s.start()
    digest = snap.fill()
    s.join(10)
    t.join(10)
    assert out["version"].digest == digest and first_group_at[0] < filled_at[-1] - 0.3
    assert {k: v for k, v in out["version"].tensors()}.keys() == ts.keys()
    assert all(torch.equal(v, snap.tensors()[k]) for k, v in ts.items())


@pytest.mark.timeout(300)
def test_a_producer_of_two_workers_gets_a_group_of_three_and_both_workers_receive_every_version(tmp_path):
    """N1: the link's group is sized from the producer's registration (1 + its 2 workers),
    the workers join at rank_offset + their rank (vLLM's numbering), and each version
    reaches both, verified, before the trainer counts it delivered. With a group of 2
    (what every link was), the second worker has no rank and the init fails."""
    from rlstream.producer.weights.trainer_link import TrainerLink

    with WorkerProcesses(2) as engine:  # forked before the trainer's threads start
        trainer = TrainerSide(tmp_path / "store", model_dir=None, timeout_s=30.0)
        sender = trainer.sender
        try:
            link = TrainerLink.connect(engine, sender.endpoint, "p-tp2", 30.0)
            for version in (1, 2):
                ts = groups_of(3 + version)
                trainer.publish(version, ts)
                deadline = time.monotonic() + 120
                while not any(lk.sent >= version for lk in list(sender.links.values())):
                    link.poll()
                    if (u := link.take_update()) is not None:  # served (no model here) or refused
                        link.answer_update(u, u.error or (None if u.received == u.expected else "digest"))
                    time.sleep(0.01)
                    assert link.dead is None and sender.failures == 0, link.dead or "the trainer dropped the link"
                    assert time.monotonic() < deadline
                got = engine.received()
                assert len(got) == 2
                for worker in got:
                    assert worker.keys() == ts.keys() and all(torch.equal(worker[k], v) for k, v in ts.items())
            (lk,) = trainer.sender.links.values()
            assert lk.workers == 2 and lk.engine.pair.world_size == 3 and trainer.sender.failures == 0
        finally:
            trainer.close()
