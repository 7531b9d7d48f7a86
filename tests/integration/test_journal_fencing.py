"""Fenced producers on the cluster twin (ops/cluster/twin.py): a producer cut off from the
journal past its lease, alive, does not get the episodes a peer took over trained twice.

Hosts: `kafka` (the real broker) and `zombie` (producer a's network: its NIC is what the
test cuts); producer b and the consumer's read path run on this machine, on the switch
through the twin's observer port. Both producers share the session's vLLM engine (a second
engine start costs ~40 s): producer a's service is built and stepped with the calling
thread inside host `zombie`'s network namespace (setns), so every socket it opens and
every thread it starts (Kafka clients, its lease renewals) lives there; `EngineShare` hands
each producer the results of its own requests.

1. a runs calculator-like episodes until some are between turns; then both stop admitting.
2. a's NIC goes down. a keeps generating: its episodes end, their records wait in its
   publisher, its lease renewals and journal writes go nowhere. After the 1 s lease, b
   claims a's unfinished episodes (claim epoch 1), resumes and publishes them.
3. a's NIC comes back: a's waiting records (epoch 0) reach the broker, a reads the journal,
   abandons the episodes still running that b holds (counted, with their wasted seconds).
4. The consumer's read path (RolloutReader, the ledger and its assembler) reads everything:
   each of a's episodes trained once (trained twice 0, lost 0, every group complete), every
   epoch-0 copy of an episode b took over sent to the DLQ (field claim_epoch). Printed: the
   wasted generation seconds (a's counter for what it abandoned, plus, for each copy the
   consumer fenced, its end minus the cut).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import subprocess
import time
from collections import Counter

import pytest

from rlstream.common import metrics
from rlstream.cluster.twin import ClusterTwin, Host, unavailable_reason
from tests.support.journaled_episodes import CLIENTS, G, Turns, config
from tests.support.topics import announce_trainer_start

_WHY = unavailable_reason()
pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(_WHY is not None, reason=f"no cluster twin here: {_WHY}")]
CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def inside(ns: str):
    """The calling thread in network namespace `ns` (and the threads and processes it starts)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home, there = os.open("/proc/thread-self/ns/net", os.O_RDONLY), os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        yield
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        os.close(there)


class EngineShare:
    """One RolloutEngine, two producers: each `view` submits, steps and aborts its own requests.

    Each producer's tags go to the engine under its name ("a|<tag>"): a taken-over episode's
    turn has the same tag on both producers (b resumes a's episode, and a, cut off, still
    runs it), which two engines never see but one shared engine would refuse as a reused tag."""

    def __init__(self, engine):
        self.engine, self.owner, self.done = engine, {}, {"a": [], "b": []}

    def view(self, name: str):
        share, prefix = self, f"{name}|"

        def ours(sample):
            return dataclasses.replace(sample, tag=sample.tag.removeprefix(prefix),
                                       request_id=sample.request_id.removeprefix(prefix))

        class View:
            def __getattr__(self, attr):
                return getattr(share.engine, attr)

            def submit_group(self, ids, n, sampling, tag):
                share.owner[prefix + tag] = name
                return [r.removeprefix(prefix) for r in share.engine.submit_group(ids, n, sampling, prefix + tag)]

            def mine(self):
                return [t for t, o in share.owner.items() if o == name]

            def has_work(self):
                return bool(share.done[name] or self.mine())

            def step(self):
                for s in share.engine.step() if share.engine.has_work() else []:
                    owner = share.owner.pop(s.tag)
                    share.done[owner].append(s)
                out, share.done[name] = [ours(s) for s in share.done[name]], []
                return out

            def generated(self, tag):
                return share.engine.generated(prefix + tag)

            def partial(self, tag):
                sample = share.engine.partial(prefix + tag)
                return None if sample is None else ours(sample)

            def abort_tag(self, tag):
                share.owner.pop(prefix + tag, None)
                return share.engine.abort_tag(prefix + tag)

            def abort_all(self):
                return sum(self.abort_tag(t.removeprefix(prefix)) for t in self.mine())

            def oldest_versions(self):
                mine = set(self.mine())
                return {t.removeprefix(prefix): v for t, v in share.engine.oldest_versions().items() if t in mine}

        return View()


def nic(twin, host: str, state: str) -> None:
    subprocess.run(["ip", "-n", twin.ns(host), "link", "set", "eth0", state], check=True, timeout=30)


def key(r) -> str:
    return f"ep:{r.group_id}#{r.sample_idx}"


class Pair:
    """Producer a (its network in host `zombie`) and producer b (on this machine), on one engine."""

    def __init__(self, twin, kafka, bootstrap: str, engine, model_dir, data):
        from rlstream.producer.service import ProducerService

        self.twin, share = twin, EngineShare(engine)
        self.services = []
        with inside(twin.ns("zombie")):
            self.a = ProducerService(config(kafka, model_dir, data, "a", True), bootstrap)
            self.services.append(self.a)
            self.a.start(engine=share.view("a"))
        self.b = ProducerService(config(kafka, model_dir, data, "b", True), bootstrap)
        self.services.append(self.b)
        self.b.start(engine=share.view("b"))
        self.b.admit = lambda: None  # b only takes over
        self.won_b, self.published_by_a = set(), []

    def step_a(self) -> None:
        with inside(self.twin.ns("zombie")):
            self.a.iterate()

    def until(self, pred, what: str, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step_a()
            self.b.iterate()

    def to_the_cut(self) -> set[str]:
        """Run until a has episodes between turns; then no new groups. Returns the keys a holds."""
        a, b, runner = self.a, self.b, self.a.driver.runner
        self.until(lambda: sum(ep.turns >= 1 for ep in runner._turns.values()) >= 2 and not a.outbox.unacked_records,
                   "a's episodes past their first turn")
        a.admit = lambda: None
        runner.journal.topic.flush(30)  # each episode a holds has its journal entry
        adopt, add = b.driver.runner.journal.adopt, a.outbox.add
        b.driver.runner.journal.adopt = lambda s: (self.won_b.add(s.key), adopt(s))
        a.outbox.add = lambda r: (self.published_by_a.append(r), add(r))
        return set(runner.journal._ids)

    def cut_takeover_heal(self, held: set[str]) -> float:
        """a's NIC down until b has taken over and published `held`; then up until a's records are
        delivered and a has read the journal again. Returns the time of the cut."""
        a, b = self.a, self.b
        nic(self.twin, "zombie", "down")
        cut = time.time()
        self.until(lambda: held <= self.won_b and not b.driver.has_work() and not b.outbox.unacked_records,
                   "b's takeover of a's episodes")
        assert [r for r in self.published_by_a if key(r) in held],\
            "a published nothing while cut off (the fencing was not exercised)"
        nic(self.twin, "zombie", "up")
        self.until(lambda: not a.outbox.unacked_records and not a.driver.has_work(), "a's records delivered", 120)
        a.driver.runner.journal._next_claim = 0.0
        self.step_a()  # a reads the journal once more
        return cut

    def close(self) -> None:
        from rlstream.common.lifecycle import close_attrs

        for svc in self.services:
            with inside(self.twin.ns("zombie")) if svc is self.services[0] else contextlib.nullcontext():
                close_attrs(svc, CLIENTS, __import__("logging").getLogger("test"))


def consume(kafka):
    """The consumer's read path over everything published: (the ledger, the fenced copies)."""
    from rlstream.common.kafka.reader import RolloutReader
    from rlstream.consumer.stream.assembler import GroupAssembler
    from rlstream.consumer.stream.ledger import Ledger

    ledger, items = Ledger(GroupAssembler(G, timeout_s=600)), []
    with RolloutReader(kafka) as reader:
        idle = 0
        while idle < 2:
            got = reader.poll(max_records=1000, timeout_s=1.0)
            idle = 0 if got else idle + 1
            items += got
    ledger.read(items)
    return ledger, ledger.take_fenced()


@pytest.mark.timeout(300)
def test_a_producer_cut_off_past_its_lease_gets_no_episode_trained_twice(rollout_engine, tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    from rlstream.common.tasks import envs
    from rlstream.common.config import BrokerSettings
    from rlstream.common.kafka.broker import EmbeddedBroker
    from rlstream.toy.build import ensure_data
    from tests.fixtures.kafka import make_kafka_settings

    monkeypatch.setitem(envs.ENVIRONMENTS, "calculator", Turns)
    fenced0 = {at: metrics.value("rlstream_producer_episodes_fenced_total", at=at) for at in ("running", "ended")}
    wasted0 = metrics.value("rlstream_producer_fenced_generation_seconds_total")
    with ClusterTwin([Host("kafka"), Host("zombie")], observer=True) as twin:
        with inside(twin.ns("kafka")):
            broker = EmbeddedBroker(BrokerSettings(host=twin.address("kafka"), port=9092)).start()
        kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2,
                                    request_timeout_ms=5000)
        data = tmp_path / "data" / "train.jsonl"
        ensure_data(config(kafka, tiny_model_dir, data, "a", True), n_train=64, n_heldout=8)
        announce_trainer_start(kafka, groups_per_batch=2, group_size=G)
        pair = Pair(twin, kafka, broker.bootstrap, rollout_engine, tiny_model_dir, data)
        try:
            held = pair.to_the_cut()
            cut = pair.cut_takeover_heal(held)
        finally:
            pair.close()
        ledger, fenced = consume(kafka)
        broker.stop()

    trained = [r for g in ledger.complete for r in g.rollouts()]
    copies = Counter(key(r) for r in trained)
    assert max(copies.values()) == 1 and len({r.rollout_id for r in trained}) == len(trained)  # trained twice: 0
    assert not [k for k in held if copies[k] != 1], "an episode a held at the cut was not trained"  # lost: 0
    assert not ledger.assembler.open_groups(), "a group never completed"
    assert fenced and all(it.rollout.claim_epoch == 0 for it, _ in fenced)  # the zombie's copies, in the DLQ
    by_b = {key(r) for r in trained if key(r) in held and r.claim_epoch == 1}
    assert {key(it.rollout) for it, _ in fenced} <= by_b
    fenced_here = {at: metrics.value("rlstream_producer_episodes_fenced_total", at=at) - fenced0[at] for at in fenced0}
    wasted = metrics.value("rlstream_producer_fenced_generation_seconds_total") - wasted0 + sum(
        max(0.0, it.rollout.created_at - cut) for it, _ in fenced)
    print(f"fencing on the twin: {len(held)} episodes held at the cut, {len(by_b)} trained from b's claim, "
          f"{len(fenced)} zombie copies fenced by the consumer, {fenced_here} fenced by a; trained twice 0, lost 0; "
          f"wasted generation {wasted:.2f} s")
