"""The producer's two small ledgers, with fakes (pure logic): the outbox in front
of the bounded publisher (producer/outbox.py) and the groups in flight
(producer/groups.py)."""
from __future__ import annotations

from concurrent.futures import Future

from rlstream.producer.groups import GroupInfo, InFlightGroups
from rlstream.common.tasks.task import Task
from rlstream.producer.outbox import Outbox


class FakePublisher:
    """A publisher whose buffer holds `room` records until `ack_all()`."""

    def __init__(self, room: int):
        self.room, self.buffer, self.published = room, [], []

    @property
    def buffer_depth(self) -> int:
        return len(self.buffer)

    def try_publish(self, record):
        if len(self.buffer) >= self.room:
            return None
        fut = Future()
        self.buffer.append((record, fut))
        return fut

    def publish(self, record, timeout):  # blocks for room, then joins the same queue
        if len(self.buffer) >= self.room:
            self.ack_all()
        self.buffer.append((record, Future()))

    def flush(self, timeout):
        self.ack_all()

    def ack_all(self):
        for record, fut in self.buffer:
            self.published.append(record)
            fut.set_result(record)
        self.buffer = []


def test_outbox_keeps_order_drops_nothing_and_reports_acknowledgements():
    pub, acked = FakePublisher(room=2), []
    box = Outbox(pub, on_delivered=lambda fut: acked.append(fut.result()))
    for i in range(5):
        box.add(i)
    box.flush()
    assert box.pending == [2, 3, 4] and box.unacked_records == 5  # buffer full: the rest waits, in order
    pub.ack_all()
    assert acked == [0, 1] and box.unacked_records == 3
    box.flush()
    assert box.pending == [4]
    box.drain()
    assert box.pending == [] and pub.published == [0, 1, 2, 3, 4] and box.unacked_records == 0


def test_groups_get_unique_ids_and_are_forgotten_after_their_last_sample():
    a, b = InFlightGroups("p0"), InFlightGroups("p0")  # two incarnations of one producer id
    ids = [a.new_id(), a.new_id()]
    assert len(set(ids + [b.new_id()])) == 3 and all(i.startswith("p0-") for i in ids)
    a.add(ids[0], GroupInfo(Task("1+1=", "2", None), remaining=2))
    a.add(ids[1], GroupInfo(Task("2+2=", "4", None), remaining=1))
    assert len(a) == 2
    assert a.finish_sample(ids[1]).task.reference == "4" and len(a) == 1
    assert a.finish_sample(ids[0]).remaining == 1 and len(a) == 1
    assert a.finish_sample(ids[0]).remaining == 0 and len(a) == 0
