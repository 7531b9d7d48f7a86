"""The producer's end of a weight link (producer/weights/trainer_link.py TrainerLink): the trainer's
commands, run between engine steps, with a fake channel and engine (pure logic; real
links are tests/integration/test_weight_link.py and test_weight_transfer.py)."""
from __future__ import annotations

import time

from rlstream.producer.weights.trainer_link import GlooLink, TrainerLink
from tests.support.fakes import FakeChannel

DIGEST = "c" * 64


class FakeEngine:
    """The rlstream_gloo engine as the link sees it: receives on `start`, reports a state."""

    weight_transfer = "rlstream_gloo"
    weight_workers = 1

    def __init__(self):
        self.state = {"state": "idle"}
        self.status_calls = 0

    def receive_weights(self):
        self.state = {"state": "receiving"}

    def weight_status(self):
        self.status_calls += 1
        return dict(self.state)


def linked() -> tuple[TrainerLink, FakeChannel, FakeEngine]:
    engine, channel = FakeEngine(), FakeChannel()
    link = GlooLink(engine, "trainer:1", "p0", 5.0)
    link.channel = channel
    return link, channel, engine


def test_a_version_is_handed_over_once_received_and_finished_and_its_finish_answered_by_the_decision():
    """The link is the version's one control channel: the trainer's finish carries its digest, the
    link hands the reloader both digests, and the finish is answered only with its decision."""
    link, channel, engine = linked()
    channel.post("start", version=3)
    channel.post("finish", version=3, digest=DIGEST)
    link.poll()
    assert channel.acks == {0: {}} and link.take_update() is None  # the bytes are still arriving
    engine.state = {"state": "ready", "version": 3, "digest": DIGEST}
    link.poll()
    u = link.take_update()
    assert (u.version, u.received, u.expected, u.staged) == (3, DIGEST, DIGEST, True) and 1 not in channel.acks
    assert link.take_update() is None  # handed over once
    link.answer_update(u)
    assert channel.acks[1] == {"version": 3, "digest": DIGEST} and link.dead is None


def test_a_refused_version_is_answered_with_why_and_the_link_stays():
    link, channel, engine = linked()
    channel.post("start", version=3)
    channel.post("finish", version=3, digest="d" * 64)
    link.poll()
    engine.state = {"state": "ready", "version": 3, "digest": DIGEST}
    link.poll()
    link.answer_update(link.take_update(), "digest differs")
    assert channel.acks[1] == {"error": "digest differs"} and link.dead is None


def test_a_version_received_before_its_finish_waits_for_it_at_most_the_timeout():
    link, channel, engine = linked()
    link.timeout_s = 0.05
    channel.post("start", version=3)
    link.poll()
    engine.state = {"state": "ready", "version": 3, "digest": DIGEST}
    link.poll()
    assert link.take_update() is None and link.dead is None
    time.sleep(0.1)
    link.poll()
    u = link.take_update()
    assert "no finish" in u.error and link.dead


def test_a_finish_with_nothing_received_is_refused_at_once_and_the_link_dies():
    link, channel, engine = linked()
    channel.post("start", version=3)
    channel.post("finish", version=3, digest=DIGEST)
    link.poll()
    engine.state = {"state": "idle"}  # the staging went (never from the link itself)
    link.poll()
    assert "nothing received" in channel.acks[1]["error"] and link.dead
    assert "nothing received" in link.take_update().error


def test_a_finish_of_a_version_never_started_is_refused():
    link, channel, engine = linked()
    channel.post("finish", version=3, digest=DIGEST)
    link.poll()
    assert "without its start" in channel.acks[0]["error"] and link.dead is None


def test_the_engine_status_is_asked_only_while_a_version_arrives():
    """`weight_status` is a collective_rpc to every worker: asked from a start until the version
    is all here, never while idle or once it waits for its finish."""
    link, channel, engine = linked()
    for _ in range(3):
        link.poll()
    assert engine.status_calls == 0
    channel.post("start", version=1)
    link.poll()
    link.poll()
    assert engine.status_calls == 2
    engine.state = {"state": "ready", "version": 1, "digest": DIGEST}
    link.poll()
    link.poll()
    assert engine.status_calls == 3 and link.update.received == DIGEST


def test_an_init_a_worker_refused_marks_the_link_dead_and_the_loop_keeps_going():
    """vLLM's multiprocess engine (TP > 1) reports a worker's error as a bare Exception: it
    used to escape poll() into the producer's loop."""
    link, channel, engine = linked()

    def refused(init_info):
        raise Exception("Call to collective_rpc method failed: link 1: rank 2 is outside its group of 2")
    engine.init_weight_link = refused
    channel.post("init", init_info={})
    link.poll()  # does not raise
    assert "rank 2 is outside" in channel.acks[0]["error"] and "rank 2 is outside" in link.dead


def test_the_receiver_is_chosen_once_by_the_engines_backend(monkeypatch):
    from rlstream.producer.weights.trainer_link import NcclLink

    monkeypatch.setattr(TrainerLink, "_register", lambda self: None)  # no endpoint to dial
    nccl = type("NcclEngine", (FakeEngine,), {"weight_transfer": "nccl"})
    assert type(TrainerLink.connect(FakeEngine(), "trainer:1", "p0", 5.0)) is GlooLink
    assert type(TrainerLink.connect(nccl(), "trainer:1", "p0", 5.0)) is NcclLink
