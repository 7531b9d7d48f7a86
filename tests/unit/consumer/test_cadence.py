"""consumer/checkpoint/cadence.py: when a checkpoint is due, the snapshot, one write in flight."""
from __future__ import annotations

import threading

import pytest
import torch

from rlstream.common.config import CheckpointSettings, ConsumerSettings, load_config
from rlstream.common.errors import CheckpointError, ConfigError
from rlstream.consumer.checkpoint.cadence import Cadence
from rlstream.consumer.checkpoint.writer import BackgroundWrite, host_copy
from tests.support.fakes import Clock


def test_due_every_n_steps_or_after_t_seconds_whichever_first():
    clock = Clock(100.0)
    c = Cadence(CheckpointSettings(every_steps=3, every_seconds=60), step=0, clock=clock)
    assert [c.due(s) for s in (0, 1, 2)] == [False, False, False]
    assert c.due(3)
    c.done(3)
    clock.t += 61  # the time trigger: one step later
    assert c.due(4)
    c.done(4)
    clock.t += 61
    assert not c.due(4), "nothing trained since the last checkpoint: never due"
    assert not c.dirty(4) and c.dirty(5)


def test_a_trigger_at_zero_is_off_and_both_off_is_refused():
    clock = Clock(100.0)
    steps_only = Cadence(CheckpointSettings(every_steps=2, every_seconds=0), clock=clock)
    clock.t += 1e6
    assert not steps_only.due(1) and steps_only.due(2)
    time_only = Cadence(CheckpointSettings(every_steps=0, every_seconds=5), clock=clock)
    assert not time_only.due(100)
    clock.t += 5
    assert time_only.due(1)
    with pytest.raises(ConfigError, match="consumer.checkpoint"):
        load_config(None, ["consumer.checkpoint.every_steps=0", "consumer.checkpoint.every_seconds=0"])


def test_defaults_checkpoint_every_ten_steps_or_ten_minutes():
    c = ConsumerSettings().checkpoint
    assert (c.every_steps, c.every_seconds) == (10, 600.0)


def test_host_copy_owns_its_memory():
    w = torch.ones(3)
    state = {"model": {"w": w}, "optimizer": {"state": {0: {"exp_avg": w * 2}}, "groups": [1, (2, 3)]}, "step": 4}
    snap = host_copy(state)
    w.add_(1)
    assert snap["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert snap["model"]["w"].data_ptr() != w.data_ptr()
    assert snap["optimizer"]["groups"] == [1, (2, 3)] and snap["step"] == 4


def test_one_write_in_flight_and_its_error_surfaces_at_wait():
    writes, gate, order = BackgroundWrite(), threading.Event(), []
    writes.start(lambda: (gate.wait(10), order.append("first")))
    assert writes.busy
    gate.set()
    writes.start(lambda: order.append("second"))  # waits for the first
    writes.wait()
    assert order == ["first", "second"] and not writes.busy

    def fail():
        raise OSError("no space left")
    writes.start(fail)
    with pytest.raises(CheckpointError, match="no space left"):
        writes.wait()
    writes.wait()  # reported once


def test_host_copy_of_device_tensors_pins_one_slab_of_exactly_their_bytes():
    """Over the GPU stand-ins (common/gpu_standin/: device memory, cudaHostRegister): the copies of
    device tensors share one registered slab of exactly their bytes, and nothing is pinned through
    the caching host allocator (`pin_memory=True`, which rounds to powers of two and stays pinned)."""
    import torch

    from rlstream.common import gpu_standin
    from rlstream.common.gpu_standin import cuda
    from rlstream.common.gpu_standin.device import device_memory, on_device, place
    from rlstream.consumer.checkpoint.writer import host_copy
    from rlstream.consumer.weights.snapshot import slab_plan

    with gpu_standin.installed(), device_memory():
        state = {"w": torch.randn(300, 7), "m": [torch.arange(5, dtype=torch.int64), torch.ones(3, dtype=torch.bfloat16)],
                 "host": torch.zeros(2), "step": 4}
        place([state["w"], *state["m"]])
        registered, pinned = dict(cuda.pinned.registered), cuda.pinned.pinned_bytes
        out = host_copy(state)
        new = {p: n for p, n in cuda.pinned.registered.items() if p not in registered}
        assert cuda.pinned.pinned_bytes == pinned, "pinned through the caching allocator"
        assert list(new.values()) == [slab_plan([300 * 7 * 4, 5 * 8, 3 * 2])[1]]  # one slab: the bytes, aligned
        assert torch.equal(out["w"], state["w"]) and not on_device(out["w"]) and out["step"] == 4
        assert all(torch.equal(a, b) for a, b in zip(out["m"], state["m"]))
        assert out["w"].data_ptr() != state["w"].data_ptr() and torch.equal(out["host"], state["host"])
