"""One version to many producers, sent once (issue 23, N4): the trainer's real sending half
(WeightSender: links, fan-out group, Snapshot), producers as lightweight receivers running
the real receive code (tests/support/weights.py WorkerProcesses: RlstreamGlooEngine in a
spawned process per worker) behind the real producer link (TrainerLink), polled as the
reloader polls it (tests/support/weights.py LinkedProducer).

The trainer's egress is counted as the bytes this process wrote (/proc/self/io wchar: gloo
writes its sockets with writev; the producers are other processes). With one link per
producer (main before issue 23) it was one copy of the version per producer."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.support.weights import LinkedProducer, TrainerSide, WorkerProcesses, random_version, wait_for

TIMEOUT_S = 6.0
GROUPS, GROUP_BYTES = 6, 1 << 20  # a 6 MiB version: big next to the store's and the pipes' bytes
GROUP_DELAY_S = 0.25  # version 3 streams slowly enough to kill a producer in the middle of it


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def slow_snapshot(sent: list):
    from rlstream.consumer.weights.snapshot import Snapshot

    class Slow(Snapshot):
        def groups(self, timeout_s: float = 600.0):
            for g, item in enumerate(super().groups(timeout_s)):
                time.sleep(GROUP_DELAY_S)
                sent.append((threading.current_thread().name, g))
                yield item
    return Slow


@pytest.mark.timeout(400)  # 39 s at load 2.4, 110-300 s at load 12-17 (2 cores): 5 processes import vLLM
def test_every_producer_gets_each_version_once_from_the_trainer_and_a_dead_relay_costs_the_others_no_more_than_a_timeout(tmp_path):
    engines = {n: WorkerProcesses(1) for n in ("p1", "p2", "p3", "p4")}  # spawned at once; p4 joins later
    trainer = TrainerSide(tmp_path / "store", model_dir=None, timeout_s=TIMEOUT_S)
    for e in engines.values():  # each worker answers once it has started (spawned: it imports vLLM)
        e.ready()
    producers = {n: LinkedProducer(n, engines[n], trainer.sender.endpoint, TIMEOUT_S) for n in ("p1", "p2", "p3")}
    stop, pollers = threading.Event(), []

    def run(p: LinkedProducer) -> None:
        p.connect()
        pollers.append(p.poll_in_thread(stop))
    for p in producers.values():
        run(p)
    try:
        # version 1: each producer joins over a link of its own and gets the current version
        msg = trainer.publish(1, random_version(1, GROUPS, GROUP_BYTES))
        wait_for("version 1 everywhere", lambda: all(p.holds(1, msg.digest) for p in producers.values()), 90)

        # (a, b) version 2: the fan-out group; every producer verified it, the trainer sent it once
        ts = sent_once(trainer, producers, 2, "for 3 producers")
        for p in producers.values():
            got = p.received()
            assert got.keys() == ts.keys() and all(torch.equal(got[k], v) for k, v in ts.items())

        msg = a_dead_relay_costs_the_others_one_timeout(trainer, producers)

        # (d) a producer joins: it gets the current version at once over its own link
        producers["p4"] = LinkedProducer("p4", engines["p4"], trainer.sender.endpoint, TIMEOUT_S)
        run(producers["p4"])
        wait_for("version 3 at the joiner", lambda: producers["p4"].holds(3, msg.digest), 20)

        # the next version re-forms the group (p1, p3 again, p4): still sent once
        wait_for("the group settled", lambda: trainer.sender.wait_delivered(3, 0.01), TIMEOUT_S * 2)
        sent_once(trainer, producers, 4, "after the re-form")
        assert len(trainer.sender.fanout.formed) == 3
    finally:
        stop.set()
        for t in pollers:
            t.join(10)
        trainer.close()
        for e in engines.values():
            e.close()


def sent_once(trainer, producers: dict, version: int, when: str) -> dict:
    """Publish `version` (random tensors): every producer holds it, and the trainer wrote its bytes
    about once (the fan-out group); the tensors."""
    sent0 = written_bytes()
    ts = random_version(version, GROUPS, GROUP_BYTES)
    msg = trainer.publish(version, ts)
    wait_for(f"version {version} everywhere", lambda: all(p.holds(version, msg.digest) for p in producers.values()),
             30)
    assert trainer.sender.wait_delivered(version, 10)
    egress = (written_bytes() - sent0) / (GROUPS * GROUP_BYTES)
    assert egress < 1.25, f"the trainer wrote {egress:.2f}x the version's bytes {when}"
    return ts


def a_dead_relay_costs_the_others_one_timeout(trainer, producers: dict):
    """(c) version 3 streams slowly; the middle of the chain (the last one receives through it)
    dies: the others hold it within a timeout, the one before it undisturbed, the one after it
    re-registered; the dead one is dropped. Version 3's announcement."""
    first, middle, last = (trainer.sender.links[n].producer for n in trainer.sender.fanout.formed)
    regs = {n: p.registrations for n, p in producers.items()}
    failures0, sent = trainer.sender.failures, []
    msg = trainer.publish(3, random_version(3, GROUPS, GROUP_BYTES), snapshot_cls=slow_snapshot(sent))
    wait_for("the group mid-version", lambda: ("rlstream-weights-fanout", 1) in sent, 20)
    killed = producers.pop(middle)
    killed.gone = True
    with killed.lock:
        killed.engine.kill()
    t_kill = time.monotonic()
    wait_for("version 3 at the other two", lambda: all(p.holds(3, msg.digest) for p in producers.values()),
             TIMEOUT_S)
    assert producers[first].registrations == regs[first]  # before the dead one in the chain: undisturbed
    assert producers[last].registrations == regs[last] + 1  # after it: re-registered, took it over its link
    wait_for("the dead one dropped", lambda: trainer.sender.failures >= failures0 + 1, TIMEOUT_S * 2)
    dropped_after = time.monotonic() - t_kill
    assert middle not in {lk.producer for lk in trainer.sender.links.values()}
    assert dropped_after < TIMEOUT_S + GROUPS * GROUP_DELAY_S + 3, dropped_after
    return msg
