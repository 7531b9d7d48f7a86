"""A synchronous (vLLM `nccl`-style) weight update through the producer's real link and
reloader (producer/weights/trainer_link.py, reload.py) with a fake engine and channel: the
digest the workers fold while loading (common/weights/digest.py, the same function the GPU
path runs, here on CPU tensors) is compared with the trainer's before the version is served;
a refused or failed update restores what was served. The real engine's restore is
tests/integration/test_weight_transfer.py."""
from __future__ import annotations

import time

import pytest
import torch

from common import metrics
from common.control.messages import WeightsReady
from common.weights.digest import fold_digest
from producer.weights.reload import Reloader
from producer.weights.trainer_link import TrainerLink
from tests.unit.producer.test_link import FakeChannel

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

    def load_weight_update(self, update_info):  # this branch: loaded, not served
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
    reloader.newest = WeightsReady(version=1, transport="collective", digest="b" * 64, endpoint="trainer:1")
    link, channel = TrainerLink(engine, "trainer:1", "p0", 5.0), FakeChannel()
    link.channel, reloader.link = channel, link
    channel.post("update", version=1, update_info={"names": list(SENT)})
    channel.post("finish", version=1, digest=fold_digest(SENT.items()))
    reloader.tick()
    return reloader, channel


def test_an_nccl_update_with_the_senders_digest_is_served(tmp_path):
    engine = FakeNcclEngine()
    _, channel = run_update(engine, tmp_path)
    assert engine.version == 1 and engine.model == "loaded" and engine.reloads == []
    assert channel.acks[1] == {"version": 1, "digest": fold_digest(SENT.items())}


@pytest.mark.parametrize("byte", [0, 37, 95])
def test_an_nccl_update_with_one_flipped_byte_is_refused_and_the_served_weights_restored(tmp_path, byte):
    before = refused()
    engine = FakeNcclEngine(flip_byte=byte)
    _, channel = run_update(engine, tmp_path)
    assert engine.version == 0, "a version with a corrupted byte was served"
    assert engine.model == "base" and engine.reloads == [(str(tmp_path), 0)]
    assert "digest" in channel.acks[1]["error"] and refused() == before + 1


def test_an_nccl_update_failing_while_loading_restores_the_served_weights(tmp_path):
    engine = FakeNcclEngine(fail=True)
    _, channel = run_update(engine, tmp_path)
    assert engine.version == 0 and engine.model == "base" and engine.reloads == [(str(tmp_path), 0)]
    assert "unknown" in channel.acks[0]["error"]


def test_an_nccl_update_whose_finish_never_comes_is_restored_within_the_timeout(tmp_path):
    engine = FakeNcclEngine()
    reloader = Reloader(engine, tmp_path, "p0", timeout_s=0.2)
    reloader.newest = WeightsReady(version=1, transport="collective", digest="b" * 64, endpoint="trainer:1")
    link, channel = TrainerLink(engine, "trainer:1", "p0", 0.2), FakeChannel()
    link.channel, reloader.link = channel, link
    channel.post("update", version=1, update_info={"names": list(SENT)})  # the trainer died after it
    t0 = time.monotonic()
    reloader.tick()
    assert time.monotonic() - t0 < 1.0
    assert engine.version == 0 and engine.model == "base" and link.dead
