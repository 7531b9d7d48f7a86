"""The fan-out group's plan (common/weights/chain.py, consumer/weights/fanout.py): one group of
the trainer and every producer's workers, ranks from `group_layout`, a chain in rank order,
a new rendezvous prefix per epoch, each member's own rank offset in its init, and failures
told apart (silent = dead or hung, an error ack = alive)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.chain import chain_plan, group_prefix
from rlstream.common.weights.link import NoAnswerError, group_layout, worker_group_rank

TP = [2, 1, 2]  # three producers: TP=2, TP=1, TP=2


def test_the_chain_runs_through_every_worker_of_every_producer_once_from_the_trainer():
    layout = group_layout(TP)
    plan = chain_plan(layout)
    assert layout.world_size == 6 and layout.rank_offsets == (1, 3, 4)
    assert [(h.rank, h.prev, h.next) for h in plan] == [
        (0, None, 1),  # the trainer sends to rank 1 only: its egress is one copy
        (1, 0, 2), (2, 1, 3),  # producer 0: its first worker relays to its second
        (3, 2, 4),  # producer 1
        (4, 3, 5), (5, 4, None)]  # producer 2: the last worker forwards to nobody
    senders = [h.rank for h in plan if h.next is not None]
    assert len(senders) == len(set(senders)) == layout.world_size - 1  # every rank sends each byte at most once
    # each worker's rank (vLLM's numbering) lands in the chain next to its producer's other worker
    second_worker_of_p2 = worker_group_rank(layout.rank_offsets[2], 0, 2, 1)
    assert plan[second_worker_of_p2].prev == worker_group_rank(layout.rank_offsets[2], 0, 2, 0)


def test_every_epoch_rendezvous_on_a_prefix_of_its_own():
    prefixes = {group_prefix(e) for e in range(1, 50)}
    assert len(prefixes) == 49 and all(p.startswith("rlstream/fanout/") for p in prefixes)


class FakeClient:
    """consumer/weights/client.py LinkClient as the fan-out calls it (the channel is the store's)."""

    def __init__(self, n, fail=None):
        self.n, self.fail, self.timeout_s, self.version = n, fail, 1.0, None
        self.inits: list[dict] = []
        self.channel = SimpleNamespace(call=lambda op, timeout_s: self._do(op))

    def _do(self, op, result=None):
        if self.fail is not None and op in self.fail[0]:
            raise self.fail[1]
        return result if result is not None else {}

    def init_weight_transfer_engine(self, init_info):
        self.inits.append(init_info)
        self._do("init")

    def start_weight_update(self):
        self._do("start")

    def finish_weight_update(self, weight_version=None):
        return self._do("finish", {"digest": "d" * 64 if self.n != 99 else "e" * 64})


def members(clients, workers):
    return [SimpleNamespace(n=c.n, client=c, workers=w, producer=f"p{c.n}") for c, w in zip(clients, workers)]


def test_each_member_joins_at_its_own_rank_offset_and_link():
    from rlstream.consumer.weights.fanout import FanoutClient

    clients = [FakeClient(n) for n in (4, 7, 9)]
    layout = group_layout(TP)
    FanoutClient(members(clients, TP), layout).init_weight_transfer_engine(
        {"rank_offset": 1, "world_size": layout.world_size, "link": 0, "group": group_prefix(3)})
    got = [(c.inits[0]["link"], c.inits[0]["rank_offset"], c.inits[0]["world_size"]) for c in clients]
    assert got == [(4, 1, 6), (7, 3, 6), (9, 4, 6)]
    ranks = sorted(worker_group_rank(c.inits[0]["rank_offset"], 0, w, r) for c, w in zip(clients, TP) for r in range(w))
    assert ranks == [1, 2, 3, 4, 5]  # every worker a rank, none twice, none beyond the group


def test_the_nccl_group_across_tp2_producers_gives_every_worker_a_rank(monkeypatch):
    """vLLM's own nccl trainer engine (consumer/weights/nccl.py open_nccl_link) over the
    fan-out client; each member's payload fed to vLLM's worker code for each of its TP ranks
    (process groups recorded, not created: no GPU here)."""
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group

    from rlstream.consumer.weights.nccl import open_nccl_link
    from rlstream.consumer.weights.fanout import FanoutClient

    groups: list[tuple[int, int]] = []
    monkeypatch.setattr(nccl_common, "stateless_init_process_group",
                        lambda addr, port, rank, world_size, device: groups.append((rank, world_size)))
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: groups.append((0, info.world_size)))
    monkeypatch.setattr(nccl_common.torch.accelerator, "current_device_index", lambda: 0)
    clients = [FakeClient(n) for n in (1, 2, 3)]
    layout = group_layout(TP)
    open_nccl_link(FanoutClient(members(clients, TP), layout), "127.0.0.1", source=object(), layout=layout)
    for c, w in zip(clients, TP):
        payload = c.inits[0]  # as the member's worker gets it: vLLM parses it, refusing unknown keys
        for rank in range(w):
            worker_init_process_group(NCCLWeightTransferInitInfo(**payload), SimpleNamespace(
                world_size=w, rank=rank, data_parallel_index=0))
    assert sorted(groups) == [(r, 6) for r in range(6)]
    with pytest.raises(WeightTransferError, match="FanoutClient"):  # vLLM alone would put all at offset 1
        open_nccl_link(clients[0], "127.0.0.1", source=object(), layout=layout)


def test_a_silent_member_is_told_apart_from_one_that_answered_an_error():
    from rlstream.consumer.weights.fanout import FanoutClient, FanoutFailure

    clients = [FakeClient(1), FakeClient(2, fail=({"ping", "start"}, NoAnswerError("no ack"))),
               FakeClient(3, fail=({"start"}, WeightTransferError("refused")))]
    fan = FanoutClient(members(clients, [1, 1, 1]), group_layout([1, 1, 1]))
    with pytest.raises(FanoutFailure) as e:
        fan.ping()
    assert e.value.op == "ping" and set(e.value.failed) == {2} and e.value.silent == {2}
    with pytest.raises(FanoutFailure) as e:
        fan.start_weight_update()
    assert set(e.value.failed) == {2, 3} and e.value.silent == {2}


def test_finish_carries_the_sent_digest_and_names_a_member_that_acknowledged_another():
    from rlstream.consumer.weights.fanout import FanoutClient, FanoutFailure

    def client(clients, workers):
        c = FanoutClient(members(clients, workers), group_layout(workers))
        c.fold = lambda: "d" * 64  # what the trainer sent
        return c

    ok = [FakeClient(1), FakeClient(2)]
    assert client(ok, [1, 1]).finish_weight_update() == {"digest": "d" * 64}
    assert all(c.fold() == "d" * 64 for c in ok)  # every member's finish carries it
    odd = ok + [FakeClient(99)]
    with pytest.raises(FanoutFailure) as e:
        client(odd, [1, 1, 1]).finish_weight_update()
    assert set(e.value.failed) == {99} and e.value.silent == set()
