"""One live link group per producer, however often it re-registers (review gpu-path-2, N6):
vLLM's nccl `init_transfer_engine` replaces its communicator without destroying the old one,
so `RolloutEngine.init_weight_link` shuts the worker's engine down first (vLLM's own
`shutdown_weight_transfer_engine`). Driven through vLLM's real Worker RPCs and its real nccl
engine class, with the communicator constructor replaced by a counting fake (no GPU here)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

LIVE: list = []  # the objects themselves: ids of collected ones are reused


class CountingCommunicator:
    """vLLM's PyNcclCommunicator as far as the group's lifetime goes: dropping the object
    does not free the NCCL communicator, only `destroy` does."""

    def __init__(self):
        LIVE.append(self)

    def destroy(self):
        LIVE.remove(self)


def nccl_worker(monkeypatch):
    """A vLLM Worker (its real weight-transfer RPCs) holding a real NCCLWeightTransferEngine."""
    from vllm.distributed.weight_transfer import nccl_engine

    monkeypatch.setattr(nccl_engine, "worker_init_process_group", lambda info, pc: CountingCommunicator())
    engine = object.__new__(nccl_engine.NCCLWeightTransferEngine)
    engine.model_update_group, engine.parallel_config = None, SimpleNamespace()
    return vllm_worker(engine)


def vllm_worker(engine):
    """vLLM's Worker, not started: only its weight-transfer RPCs run."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.weight_transfer_engine, worker._weight_update_active = engine, False
    return worker


class FakeLLMEngine:
    """vLLM's LLMEngine.collective_rpc, by name, on one worker."""

    def __init__(self, worker):
        self.worker = worker

    def collective_rpc(self, method, kwargs=None):
        return [getattr(self.worker, method)(**(kwargs or {}))]


def rollout_engine(llm_engine, backend: str):
    from rlstream.producer.engine import RolloutEngine

    eng = object.__new__(RolloutEngine)
    eng._engine, eng.weight_transfer, eng._thread = llm_engine, backend, threading.get_ident()
    return eng


def test_three_nccl_registrations_leave_one_live_communicator(monkeypatch):
    LIVE.clear()
    worker = nccl_worker(monkeypatch)
    eng = rollout_engine(FakeLLMEngine(worker), "nccl")
    info = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    for _ in range(3):  # the link died and the producer registered again, three times
        eng.init_weight_link(info)
    assert len(LIVE) == 1, f"{len(LIVE)} live communicators after 3 registrations"
    eng.close_weight_link()
    assert not LIVE


def test_three_gloo_registrations_leave_one_live_group(monkeypatch):
    from rlstream.producer.weights.worker import gloo_engine

    pairs: list = []

    class CountingPair:
        @classmethod
        def open(cls, store, link, rank, timeout_s, world_size=2):
            pairs.append(cls())
            return pairs[-1]

        def close(self):
            pairs.remove(self)

    monkeypatch.setattr(gloo_engine, "GlooPair", CountingPair)
    monkeypatch.setattr(gloo_engine, "open_store", lambda host, port, timeout_s: object())
    engine = object.__new__(gloo_engine.RlstreamGlooEngine)
    engine.pair = None
    engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    eng = rollout_engine(FakeLLMEngine(vllm_worker(engine)), "rlstream_gloo")
    for link in range(3):
        eng.init_weight_link({"host": "127.0.0.1", "port": 1, "link": link, "world_size": 2, "rank_offset": 1})
    assert len(pairs) == 1


def test_a_link_is_not_closed_under_a_running_update(monkeypatch):
    worker = nccl_worker(monkeypatch)
    worker._weight_update_active = True
    eng = rollout_engine(FakeLLMEngine(worker), "nccl")
    with pytest.raises(RuntimeError, match="during a weight update"):
        eng.close_weight_link()
