"""consumer/weights/durable.py: the durable store written in the background every K versions and at
shutdown (real WeightStore on a temp dir; snapshots are plain tensors)."""
from __future__ import annotations

import threading

import torch

from rlstream.common.weights.store import WeightStore, verify
from rlstream.consumer.weights.durable import DurableWriter


class FakeSnapshot:
    def __init__(self, version: int, gate: threading.Event | None = None):
        self.version, self.gate, self.users = version, gate, 0
        self.writing = threading.Event()

    def tensors(self):
        self.writing.set()
        if self.gate is not None:
            self.gate.wait(10)
        return {"w": torch.full((4,), float(self.version))}

    def acquire(self):
        self.users += 1
        return self

    def release(self):
        self.users -= 1


def test_only_every_kth_version_is_written_and_announced_as_the_newest_copy(tmp_path):
    store = WeightStore(tmp_path / "w", keep=10)
    dw = DurableWriter(store, str(tmp_path), every=3)
    snaps = [FakeSnapshot(v) for v in range(1, 8)]
    for s in snaps:  # one version per training step
        dw.maybe_write(s)
        dw.flush(None)
    assert store.versions() == [3, 6]
    assert dw.newest.version == 6 and verify(dw.newest.uri, dw.newest.sha256, dw.newest.bytes)
    assert all(s.users == 0 for s in snaps)  # every snapshot released: its buffers may be reused
    dw.flush(snaps[-1])  # shutdown: the last version, whatever K says
    assert store.versions() == [3, 6, 7] and dw.newest.version == 7
    dw.close()


def test_a_version_due_while_one_is_written_waits_and_a_newer_one_replaces_it(tmp_path):
    store = WeightStore(tmp_path / "w", keep=10)
    dw = DurableWriter(store, str(tmp_path), every=1)
    gate = threading.Event()
    slow = FakeSnapshot(1, gate)
    dw.maybe_write(slow)
    assert slow.writing.wait(10)  # the writer is inside version 1
    for v in (2, 3, 4):
        dw.maybe_write(FakeSnapshot(v))
    gate.set()
    dw.flush(None)
    assert store.versions() == [1, 4]  # 2 and 3 were replaced while 1 was being written
    dw.close()


def test_a_restarted_consumer_announces_what_the_store_already_holds(tmp_path):
    store = WeightStore(tmp_path / "w", keep=10)
    first = DurableWriter(store, str(tmp_path), every=1)
    first.flush(FakeSnapshot(5))
    first.close()
    again = DurableWriter(WeightStore(tmp_path / "w", keep=10), str(tmp_path), every=10)
    assert again.newest == first.newest and again.newest.version == 5
    again.close()
