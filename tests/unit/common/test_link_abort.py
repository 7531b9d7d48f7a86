"""A closing trainer abandons its links' waits for acks (common/weights/link.py Channel.abandon,
consumer/weights/sender.py WeightSender.close).

Found through test_runtime_control's 32 s teardown: the pipeline stops the producer first; the
consumer had just sent it a version and waited the whole link timeout (30 s) for the `finish`
ack of a producer that was gone before it could exit.
"""
from __future__ import annotations

import threading
import time

import pytest

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights import link
from rlstream.common.weights.link import Channel, NoAnswerError


@pytest.fixture
def store():
    return link.open_store("127.0.0.1", 0, 30.0, master=True)


def other_connection(store):
    return link.open_store("127.0.0.1", store.port, 30.0)


def test_a_closing_trainer_stops_waiting_for_an_ack_at_once(store):
    channel = Channel(other_connection(store), 1)  # a link's own connection, blocked in its wait
    threading.Timer(0.3, channel.abandon, (store, "the trainer is closing")).start()
    t0 = time.monotonic()
    with pytest.raises(WeightTransferError, match="abandoned: the trainer is closing"):
        channel.call("finish", timeout_s=30.0)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(WeightTransferError, match="abandoned"):  # and every later call, without waiting
        channel.call("init", timeout_s=30.0)
    assert time.monotonic() - t0 < 3.0


def test_an_ack_still_ends_the_wait_and_no_ack_still_times_out(store):
    trainer, producer = Channel(other_connection(store), 2), Channel(other_connection(store), 2)

    def answer():
        while (cmd := producer.next_command()) is None:
            time.sleep(0.01)
        producer.ack(cmd[0], served=cmd[1]["version"])
    threading.Thread(target=answer, daemon=True).start()
    assert trainer.call("finish", timeout_s=5.0, version=7) == {"served": 7}
    t0 = time.monotonic()
    with pytest.raises(NoAnswerError, match="no ack to 'start'"):
        trainer.call("start", timeout_s=0.6)  # nobody answers: the timeout
    assert 0.5 < time.monotonic() - t0 < 2.0



def quiet_producer(port: int) -> None:
    """A producer that registers, joins its link's group on `init`, then stops answering (it
    is stopping): the trainer's link waits for its answer to `start`."""
    store = link.open_store("127.0.0.1", port, 30.0)
    channel = Channel(store, link.register(store, "p-stopping"))
    while (cmd := channel.next_command()) is None:
        time.sleep(0.01)
    k, init = cmd[0], cmd[1]["init_info"]
    threading.Thread(target=channel.ack, args=(k,), daemon=True).start()  # while joining: the trainer joins too
    link.GlooPair.open(link.open_store("127.0.0.1", port, 30.0), init["link"], init["rank_offset"], 30.0,
                       world_size=init["world_size"])


def test_the_sender_closes_at_once_while_a_producer_does_not_answer():
    """Closing the sender ends its link's wait for the stopped producer's answer instead of
    joining the link's thread for the whole timeout (30 s)."""
    import torch

    from rlstream.common.config import WeightSyncSettings
    from rlstream.consumer.weights.snapshot import Snapshot
    from rlstream.consumer.weights.sender import WeightSender
    from tests.support.weights import dict_source

    sender = WeightSender(WeightSyncSettings(host="127.0.0.1", port=0, timeout_s=30.0), topology="star")
    try:
        threading.Thread(target=quiet_producer, args=(sender.store.port,), daemon=True).start()
        snap = Snapshot(1, dict_source({"w": torch.ones(4)}))
        sender.publish(snap)
        snap.fill()
        deadline = time.monotonic() + 20
        while not any(lk.client is not None and lk.client.channel._waiting and lk.engine is not None
                      for lk in sender.links.values()):
            assert time.monotonic() < deadline, "the link never waited for the producer's start"
            time.sleep(0.05)
    finally:
        t0 = time.monotonic()
        sender.close()
    assert time.monotonic() - t0 < 5.0
