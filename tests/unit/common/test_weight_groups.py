"""Weight groups sized from what each producer reports (common/weights/link.py): N1, where every
link was a 2-rank group while the producers run tensor_parallel_size 2, so vLLM numbered the
second worker 2 and `StatelessProcessGroup` refused it (rank < world_size)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights import link
from rlstream.common.weights.link import (
    GroupLayout,
    group_layout,
    read_registration,
    register,
    worker_group_rank,
)


def test_a_group_has_the_trainer_then_each_producers_workers():
    assert group_layout([1]) == GroupLayout(2, (1,))
    assert group_layout([2]) == GroupLayout(3, (1,))  # a TP=2 producer: ranks 1 and 2
    assert group_layout([2, 1, 4]) == GroupLayout(8, (1, 3, 4))
    for bad in ([0], [link.MAX_WORKERS + 1]):
        with pytest.raises(WeightTransferError, match="workers"):
            group_layout(bad)


@pytest.fixture
def store():
    return link.open_store("127.0.0.1", 0, 5.0, master=True)


def test_a_registration_carries_the_producers_worker_count(store):
    n = register(store, "p-tp2", workers=2)
    assert read_registration(store, n, 1.0) == link.Registration("p-tp2", 2)


@pytest.mark.parametrize("raw, why", [("p-old", "upgrade the producer"),
                                      ('{"producer": "p", "workers": 0}', "0 workers"),
                                      ('{"producer": "p"}', "upgrade the producer")])
def test_a_registration_without_a_usable_worker_count_is_refused(store, raw, why):
    n = int(store.add(link.ROOT + "joins", 1))
    store.set(f"{link.ROOT}link/{n}/who", raw)
    with pytest.raises(WeightTransferError, match=why):
        read_registration(store, n, 1.0)


def tp(rank: int, tp_size: int = 2, dp_index: int = 0):
    return SimpleNamespace(world_size=tp_size, rank=rank, data_parallel_index=dp_index)


def test_the_nccl_link_of_a_tp2_producer_gives_both_of_its_workers_a_rank(store, monkeypatch):
    """The review's sketch: the trainer's real nccl link init (consumer/weights/nccl.py, vLLM's
    trainer engine), its init payload fed to vLLM's own worker code for both TP ranks; the
    process groups are recorded instead of created (no GPU here)."""
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group

    from rlstream.consumer.weights.nccl import open_nccl_link

    groups: list[tuple[int, int]] = []
    monkeypatch.setattr(nccl_common, "stateless_init_process_group",
                        lambda addr, port, rank, world_size, device: groups.append((rank, world_size)))
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: groups.append((0, info.world_size)))
    monkeypatch.setattr(nccl_common.torch.accelerator, "current_device_index", lambda: 0)

    class Client:  # consumer/weights/client.py LinkClient: the init command, captured
        payload = None

        def init_weight_transfer_engine(self, init_info):
            Client.payload = init_info

    n = register(store, "p-tp2", workers=2)  # what the producer reports (TrainerLink._register)
    layout = group_layout([read_registration(store, n, 1.0).workers])  # what the trainer's link does
    open_nccl_link(Client(), "127.0.0.1", source=object(), layout=layout)
    for rank in (0, 1):  # each TP worker runs vLLM's init with the payload
        worker_init_process_group(NCCLWeightTransferInitInfo(**Client.payload), tp(rank))
    assert sorted(groups) == [(0, 3), (1, 3), (2, 3)]
    assert all(rank < world for rank, world in groups)


@pytest.mark.parametrize("rank, tp_size, dp_index", [(0, 1, 0), (1, 2, 0), (3, 4, 1), (0, 2, 2)])
def test_the_gloo_twin_numbers_workers_as_vllms_nccl_does(rank, tp_size, dp_index, monkeypatch):
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group

    seen = []
    monkeypatch.setattr(nccl_common, "stateless_init_process_group", lambda a, p, r, w, device: seen.append(r))
    monkeypatch.setattr(nccl_common.torch.accelerator, "current_device_index", lambda: 0)
    info = NCCLWeightTransferInitInfo(master_address="h", master_port=1, rank_offset=5, world_size=100)
    worker_init_process_group(info, tp(rank, tp_size, dp_index))
    assert seen == [worker_group_rank(5, dp_index, tp_size, rank)]


def test_the_engines_status_is_ready_only_when_every_worker_holds_the_same_version():
    from rlstream.producer.weights.worker.gloo_engine import combine_worker_status

    def st(state, version=None, digest=None, **kw):
        return {"state": state, "version": version, "digest": digest, "error": None, "digest_mismatch": False, **kw}

    ready = st("ready", 3, "d" * 64)
    assert combine_worker_status([ready, dict(ready)]) == ready
    assert combine_worker_status([ready, st("receiving")])["state"] == "receiving"
    assert combine_worker_status([st("idle"), st("idle")])["state"] == "idle"
    bad = combine_worker_status([ready, st("failed", error="group 1: digest", digest_mismatch=True)])
    assert bad["state"] == "failed" and bad["digest_mismatch"]
    split = combine_worker_status([ready, st("ready", 3, "e" * 64)])
    assert split["state"] == "failed" and not split["digest_mismatch"] and "different versions" in split["error"]
