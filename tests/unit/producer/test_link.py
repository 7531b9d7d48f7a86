"""The producer's end of a weight link (producer/weights/trainer_link.py TrainerLink): the trainer's
commands, run between engine steps, with a fake channel and engine (pure logic; real
links are tests/integration/test_weight_link.py and test_weight_transfer.py)."""
from __future__ import annotations

from producer.weights.trainer_link import TrainerLink

DIGEST = "c" * 64


class FakeChannel:
    """common/weights/link.py Channel: commands posted by the trainer, acks recorded."""

    link = 1

    def __init__(self):
        self.commands: list[dict] = []
        self.acks: dict[int, dict] = {}
        self._seen = 0

    def post(self, op: str, **args) -> None:
        self.commands.append({"op": op, **args})

    def next_command(self):
        if self._seen == len(self.commands):
            return None
        k, self._seen = self._seen, self._seen + 1
        return k, self.commands[k]

    def ack(self, k: int, **result) -> None:
        self.acks[k] = result


class FakeEngine:
    """The rlstream_gloo engine as the link sees it: receives on `start`, reports a state."""

    weight_transfer = "rlstream_gloo"
    weight_workers = 1

    def __init__(self):
        self.state = {"state": "idle"}

    def receive_weights(self):
        self.state = {"state": "receiving"}

    def weight_status(self):
        return dict(self.state)


def linked() -> tuple[TrainerLink, FakeChannel, FakeEngine]:
    engine, channel = FakeEngine(), FakeChannel()
    link = TrainerLink(engine, "trainer:1", "p0", 5.0)
    link.channel = channel
    return link, channel, engine


def test_finish_is_answered_with_the_received_version_once_the_receive_ended():
    link, channel, engine = linked()
    channel.post("start", version=3)
    channel.post("finish", version=3)
    link.poll()
    assert channel.acks == {0: {}}  # finish waits while the bytes arrive
    engine.state = {"state": "ready", "version": 3, "digest": DIGEST}
    link.poll()
    assert channel.acks[1] == {"version": 3, "digest": DIGEST} and link.dead is None


def test_a_version_swapped_in_before_its_finish_was_answered_is_acknowledged():
    """The receive ends and the reloader swaps it in (its announcement was already there) in
    the same tick, before the link answers the trainer's finish: the engine is idle again.
    Answering "nothing received" made the trainer drop a link that had delivered (seen in
    tests/bench/weights.py: links re-registered every few versions)."""
    link, channel, engine = linked()
    channel.post("start", version=3)
    channel.post("finish", version=3)
    link.poll()
    link.swapped, engine.state = (3, DIGEST), {"state": "idle"}  # what the reloader's swap leaves
    link.poll()
    assert channel.acks[1] == {"version": 3, "digest": DIGEST} and link.dead is None


def test_a_finish_with_nothing_received_is_refused_and_the_link_dies():
    link, channel, engine = linked()
    link.swapped = (2, DIGEST)  # an older version: not this finish's
    channel.post("start", version=3)
    channel.post("finish", version=3)
    link.poll()
    engine.state = {"state": "idle"}
    link.poll()
    assert "error" in channel.acks[1] and link.dead


def test_a_started_receive_is_reported_once_to_the_reloader():
    link, channel, engine = linked()
    link.poll()
    assert not link.take_started()
    channel.post("start", version=3)
    link.poll()
    assert link.take_started() and not link.take_started()


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
