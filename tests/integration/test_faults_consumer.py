"""Issues #8.1 and #14.7: SIGKILL the consumer at random points and between
checkpoints, several times; exactly-once holds in the final model's lineage.

One scenario per module (consumer restarts are the expensive part), checked
by several tests. A `SyntheticFeeder` publishes fresh, certainly-stale and
partial groups and a few undecodable records while the real consumer
(subprocess, real broker, real Megatron-core on the tiny model) trains; like
a producer, it stamps fresh groups with the newest version announced on the
policy topic. The consumer checkpoints every CADENCE steps, so most kills
leave steps after the last checkpoint that die and are redone. It is
SIGKILLed (whole process group) seven times, each time aimed at a phase
observed from outside:

- fetch:      the feeder is held and the consumer's lag is 0: it waits in next_batch;
- train:      data is plentiful, no checkpoint or weight write is under way and the
              main thread's stack, which the consumer writes to its log on SIGUSR1,
              is in the trainer's step;
- checkpoint: a `.step-*.tmp-*` directory exists (the background write in progress);
- publish:    a `.v*.tmp-*` directory exists in the weight store;
- between:    steps were trained since the last committed checkpoint, no write under way;
- random:     a uniformly random moment.

The kill records what was observed (so the report says which phases were hit).
Before the first start, 4 * B groups of version 0 are already on the topic: a
burst the consumer reads in one poll while its version advances, which pins
down the staleness bound at the optimizer step.

At the end the feeder stops, the consumer drains (partial groups time out),
one or two fresh filler groups flush the last half batch, and a SIGTERM makes
it checkpoint and write its exact outcome counters to its run file. Ground
truth comes from outside the consumer: what the feeder got acknowledged, the
audit log read through the final checkpoint's lineage (tests/support/audit.py),
the DLQ and policy topics. Each incarnation's run file also says the step and
version it resumed at.

Issue 24.2: the records a step lost at a kill had trained are trained again
into the final lineage (a restart renumbers the restored model above the dead
versions; the gate must not count that jump as staleness), and the staleness
bound holds in steps of the lineage, a redone record judged at the step it was
first gated at (the audit log says which).
"""
from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from rlstream.common import stacks
from rlstream.harness.census import read_dlq
from rlstream.harness.supervisor import Service, wait_until
from tests.fixtures.kafka import make_kafka_settings
from tests.support.audit import audit_lines, committed_checkpoint, lineage_entries
from tests.support.configs import service_config, write_config
from tests.support.feeder import PolicyVersion, SyntheticFeeder, flush_half_batch
from tests.support.progress import working
from tests.support.synthetic import publish_groups, synthetic_group
from tests.support.topics import announced_versions, latest_policy, weights_announcements

# One timeout for every test: the module's scenario (7 SIGKILLs, 8 consumer incarnations) runs in
# whichever test asks for it first, the first in file order or the one a rerun (-k, --lf) selects.
pytestmark = [pytest.mark.broker, pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(1500)]

G, B, MAX_STALENESS, TIMEOUT_S = 4, 2, 1, 6.0
CADENCE = 3  # consumer.checkpoint.every_steps
KILL_PLAN = ("fetch", "train", "checkpoint", "publish", "between", "between", "random")
STALL_S = 120
"""The longest wait without the consumer's progress (tests/support/progress.py): a loaded machine is slow."""


def _audit_lines(ckpt: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in (ckpt / "trained.jsonl").read_text().splitlines() if x.strip()]


def _last_step(ckpt: Path) -> int:
    """The step of the newest audit line (the running incarnation's, once it trained one)."""
    lines = _audit_lines(ckpt) if (ckpt / "trained.jsonl").exists() else []
    return lines[-1]["step"] if lines else 0


def _main_thread_section(dump: str) -> str | None:
    """The main thread's frames in the consumer's stacks (common/stacks.py: every thread,
    the main thread first, most recent call last); None while they are not all written."""
    begin = dump.find(stacks.BEGIN)
    end = dump.find(stacks.END, begin)
    if begin < 0 or end < 0:
        return None
    main = dump[begin:end].split("\nThread ")[1]
    return main if main.startswith("MainThread ") else None


def _in_training_step(stack: str) -> bool:
    """The stack passes through the trainer's step (consumer/train/trainer.py)."""
    return re.search(r'consumer/train/trainer\.py", line \d+, in train_step$', stack, re.M) is not None


def _main_thread_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class Scenario:
    def __init__(self, kafka, cfg, tmp: Path):
        self.kafka, self.cfg, self.tmp = kafka, cfg, tmp
        self.ckpt = Path(cfg.consumer.checkpoint_dir)
        self.weights = Path(cfg.consumer.weight_store_dir)
        self.consumer = Service("consumer", write_config(cfg, tmp / "consumer.yaml"), tmp / "logs")
        self.kills: list[dict] = []
        self.start_steps: list[int] = []  # per incarnation: the step it started (resumed) at
        self.start_versions: list[int] = []  # ... and the version
        self.burst_ids: list[str] = []
        self.feeder = SyntheticFeeder(kafka, G, seed=7, rate_groups=3.0, p_partial=0.1, p_stale=0.15,
                                      p_bad=0.06, version_of=PolicyVersion(kafka),
                                      stale_after=MAX_STALENESS + 1)

    def tmp_dirs(self) -> tuple[bool, bool]:
        ck = any(self.ckpt.glob(".step-*.tmp-*")) if self.ckpt.exists() else False
        wt = any(self.weights.glob(".v*.tmp-*")) if self.weights.exists() else False
        return ck, wt

    def start_consumer(self) -> None:
        n_lines = audit_lines(self.ckpt)
        self.consumer.start()
        # resumed (or started) and trained at least one more step
        wait_until(lambda: audit_lines(self.ckpt) > n_lines, STALL_S,
                   f"a step of consumer incarnation {self.consumer.incarnation}", [self.consumer],
                   progress=working(self.consumer))
        # the run file's start record (written before the first step): the step and version it resumed at
        self.start_steps.append(self.consumer.status()["step"])
        self.start_versions.append(self.consumer.status()["version"])

    def between_checkpoints(self) -> bool:
        """This incarnation trained steps since the last committed checkpoint, and no checkpoint
        write is under way (a weight-store staging dir may be a dead incarnation's: the publish
        kill leaves one)."""
        committed = committed_checkpoint(self.ckpt)
        return _last_step(self.ckpt) > (committed.step if committed else 0) and not self.tmp_dirs()[0]

    def aim_and_kill(self, phase: str, rng: random.Random) -> dict:
        """Wait for the moment `phase` names (as seen from outside), SIGKILL the consumer; the kill's record."""
        return self._kill(phase, self._aim(phase, rng))

    def _aim(self, phase: str, rng: random.Random) -> str:
        """What was seen when the moment came ("timeout": the moment did not come within 60 s)."""
        deadline = time.monotonic() + 60
        if phase == "fetch":
            return self._aim_at_fetch()
        if phase == "random":
            time.sleep(rng.uniform(0.0, 4.0))
            return "random"
        if phase == "between":
            wait_until(self.between_checkpoints, STALL_S, "a step after the last checkpoint", [self.consumer],
                       interval_s=0.01, progress=working(self.consumer))
            return "between"
        if phase == "train":  # give it a backlog, so it trains step after step
            self.feeder.hold()
            time.sleep(1.0 / self.feeder.rate + 0.5)
            self._backlog()
        return self._aim_at_write_or_step(phase, deadline)

    def _backlog(self) -> float:
        """8 steps of fresh groups at once (a tiny-model step takes ~30-100 ms); when it was sent."""
        for _ in range(8 * B):
            self.feeder.publish_one("fresh")
        return time.monotonic()

    def _aim_at_fetch(self) -> str:
        """Hold the feed until the consumer has read everything and waits in next_batch."""
        c, pid = self.consumer, self.consumer.pid
        self.feeder.hold()
        # the consumer reads everything there is, then waits in next_batch
        wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0, STALL_S, "lag 0", [c],
                   progress=working(c))
        stable = {"n": -1, "since": time.monotonic()}

        def no_step_for_2s():
            n_now = audit_lines(self.ckpt)
            if n_now != stable["n"]:
                stable.update(n=n_now, since=time.monotonic())
            return time.monotonic() - stable["since"] > 2.0
        wait_until(no_step_for_2s, STALL_S, "the consumer to wait for data", [c], interval_s=0.1,
                   progress=working(c))
        n = audit_lines(self.ckpt)
        states = []
        for _ in range(60):  # 3 s: mostly asleep in the Kafka fetch (state S), no step taken
            states.append(_main_thread_state(pid))
            time.sleep(0.05)
        idle = states.count("S") >= 0.8 * len(states)
        return "fetch" if audit_lines(self.ckpt) == n and idle else f"fetch? {''.join(states)}"

    def _aim_at_write_or_step(self, phase: str, deadline: float) -> str:
        """Poll until a checkpoint write ("checkpoint"), a weight-store write ("publish") or a
        training step ("train") is under way, until `deadline`."""
        pid, fed = self.consumer.pid, time.monotonic()
        while time.monotonic() < deadline:
            if phase == "train" and time.monotonic() - fed > 2.0:
                # the backlog's steps (well under a second) all fell between two looks on a
                # loaded machine: another backlog, another run of steps to catch
                fed = self._backlog()
            ck, wt = self.tmp_dirs()
            if phase == "checkpoint" and ck:
                return "checkpoint"
            if phase == "publish" and wt:
                return "publish"
            if phase == "train" and not ck and not wt and _main_thread_state(pid) == "R":
                # on-CPU, but where? In a step the main thread is seldom on-CPU for long (a run
                # that trained 170 steps in 60 s had it in state R at 1.5 % of 57,000 looks and
                # never 5 looks in a row), so the stack it writes on SIGUSR1 says
                if _in_training_step(self._main_stack()) and not any(self.tmp_dirs()):
                    return "train"
            time.sleep(0.0005)
        return "timeout"

    def _main_stack(self) -> str:
        """The main thread's stack as the consumer writes it on SIGUSR1 (common/stacks.py);
        "" when none came within 1 s."""
        log = self.consumer.log_path()
        start = log.stat().st_size
        os.kill(self.consumer.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with log.open("rb") as f:
                f.seek(start)
                dump = f.read().decode(errors="replace")
            stack = _main_thread_section(dump)
            if stack is not None:
                return stack
            time.sleep(0.001)
        return ""

    def _kill(self, phase: str, observed: str) -> dict:
        """SIGKILL the consumer; what was aimed at and seen, and the state around the kill."""
        c = self.consumer
        ck, wt = self.tmp_dirs()
        lines_before, committed_before = audit_lines(self.ckpt), committed_checkpoint(self.ckpt)
        trained_before = _last_step(self.ckpt)  # this incarnation's newest step
        rc = c.kill()
        committed = committed_checkpoint(self.ckpt)  # a background commit may have landed meanwhile
        kill = {"aimed": phase, "observed": observed, "rc": rc, "ckpt_tmp": ck, "weights_tmp": wt,
                "audit_lines": lines_before, "trained_step": trained_before,
                "committed_step": committed_before.step if committed_before else 0,
                "committed_after": committed.step if committed else 0,
                "committed_version": committed.version if committed else 0,
                "announced": max((a.version for a in weights_announcements(self.kafka)), default=0)}
        self.kills.append(kill)
        self.feeder.go()
        return kill

    def drain_and_stop(self) -> dict:
        c = self.consumer
        self.feeder.stop()
        assert self.feeder.error is None, self.feeder.error
        wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0
                   and c.try_metric("rlstream_consumer_open_groups") == 0, STALL_S, "drained", [c], interval_s=0.5,
                   progress=working(c))
        # flush a possible half batch: fillers until one step consumed them (then ready is empty)
        def note(fill):
            for r in fill:
                self.feeder.out.versions[r.rollout_id] = r.policy_version
                self.feeder.out.group_of[r.rollout_id] = r.group_id
        version = PolicyVersion(self.kafka)
        flush_half_batch(self.kafka, self.ckpt, c, G, B, on_publish=note, version_of=version)
        version.close()
        wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0
                   and c.try_metric("rlstream_consumer_open_groups") == 0, STALL_S, "drained", [c], interval_s=0.5,
                   progress=working(c))
        time.sleep(1.0)
        rc = c.stop(timeout_s=120)
        assert rc == 0, c.log_tail()
        final = c.final()
        assert final is not None, c.log_tail()
        return final["outcomes"]


@pytest.fixture(scope="module")
def scenario(broker, tiny_model_dir, tmp_path_factory):
    import numpy as np

    from rlstream.common.kafka.publisher import RolloutPublisher

    tmp = tmp_path_factory.mktemp("faults-consumer")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    cfg = service_config(kafka, tiny_model_dir, tmp, G=G, B=B, staleness={"max_staleness": MAX_STALENESS},
                         consumer={"group_timeout_s": TIMEOUT_S, "checkpoint": {"every_steps": CADENCE}})
    sc = Scenario(kafka, cfg, tmp)
    rng = np.random.default_rng(3)
    burst = [synthetic_group(f"burst-{i}", G, 0, rng) for i in range(4 * B)]
    with RolloutPublisher(kafka) as pub:
        sc.burst_ids = publish_groups(pub, burst)
    for g in burst:
        for r in g:
            sc.feeder.out.versions[r.rollout_id] = 0
            sc.feeder.out.group_of[r.rollout_id] = g[0].group_id
    t0 = time.monotonic()
    try:
        sc.start_consumer()
        sc.first_start_s = time.monotonic() - t0
        sc.feeder.start()
        krng = random.Random(8)
        for phase in KILL_PLAN:  # each restart must have a checkpoint to resume from
            wait_until(lambda: committed_checkpoint(sc.ckpt) is not None, STALL_S, "a checkpoint", [sc.consumer],
                       progress=working(sc.consumer))
            sc.aim_and_kill(phase, krng)
            sc.start_consumer()
            assert sc.start_steps[-1] >= 1, sc.consumer.log_tail()  # resumed from a checkpoint
        sc.outcomes = sc.drain_and_stop()
        sc.final_version = sc.consumer.final()["version"]
        sc.dlq = read_dlq(kafka)
        sc.announced = weights_announcements(kafka)
        sc.audit = _audit_lines(sc.ckpt)
        sc.wall_s = time.monotonic() - t0
    finally:
        if sc.feeder.is_alive():
            sc.feeder.stop()
        if sc.consumer.alive:
            sc.consumer.kill()
    print("\nconsumer fault scenario:", {"kills": sc.kills, "outcomes": sc.outcomes,
                                        "published_valid": sc.feeder.out.valid, "bad": sc.feeder.out.bad,
                                        "dlq_messages": len(sc.dlq), "wall_s": round(sc.wall_s, 1)})
    return sc


def test_each_kill_was_a_real_crash_and_every_restart_resumed(scenario):
    assert len(scenario.kills) == len(KILL_PLAN)
    for k in scenario.kills:
        assert k["rc"] == -9, k
    assert scenario.consumer.incarnation == len(KILL_PLAN) + 1
    # every restart resumed from a checkpoint, at least the one committed before its kill
    assert len(scenario.start_steps) == scenario.consumer.incarnation
    for k, resumed_at in zip(scenario.kills, scenario.start_steps[1:]):
        assert resumed_at >= max(1, k["committed_step"]), (k, resumed_at)
        assert resumed_at == k["committed_after"], (k, resumed_at)  # the newest committed one
    # the aimed phases were observed (the checkpoint and publish windows are milliseconds:
    # at least one of the two must have been caught for the run to mean something)
    observed = {k["observed"] for k in scenario.kills}
    assert {"fetch", "train", "between"} <= observed, scenario.kills
    assert observed & {"checkpoint", "publish"}, scenario.kills


def test_kills_between_checkpoints_redid_the_lost_steps(scenario):
    """With a cadence of CADENCE steps, kills left trained steps without a checkpoint;
    the lineage took those step numbers from a later run."""
    lost = [k for k in scenario.kills if k["trained_step"] > k["committed_after"]]
    assert len(lost) >= 2, scenario.kills
    lineage = lineage_entries(scenario.ckpt)
    for k in lost:
        assert k["trained_step"] in lineage, (k, max(lineage))
        redone = lineage[k["trained_step"]]
        dead = [e for e in scenario.audit if e["step"] == k["trained_step"] and e["run"] != redone["run"]]
        assert dead, f"step {k['trained_step']} was lost at a kill but never redone by another run"


def test_no_rollout_trained_twice_and_steps_contiguous(scenario):
    """In the lineage of the final model: steps 1..N, each once, nothing trained twice."""
    steps = {s: e["trained"] for s, e in lineage_entries(scenario.ckpt).items()}
    assert sorted(steps) == list(range(1, max(steps) + 1))
    trained = [rid for ids in steps.values() for rid in ids]
    dup = [rid for rid, n in Counter(trained).items() if n > 1]
    assert not dup, f"{len(dup)} rollout_ids trained twice"
    out = scenario.feeder.out
    assert set(trained) <= set(out.versions), "trained something that was never published"
    assert not {out.group_of[r] for r in trained} & out.partial_groups, "a partial group was trained"
    assert not {out.group_of[r] for r in trained} & out.stale_groups, "a certainly-stale group was trained"
    assert all(len(ids) == B * G for ids in steps.values())


def test_every_published_record_is_accounted_for(scenario):
    """published = trained + dropped_stale + filtered + timed_out (+ the undecodable ones in the DLQ)."""
    o, out = scenario.outcomes, scenario.feeder.out
    trained = {rid for e in lineage_entries(scenario.ckpt).values() for rid in e["trained"]}
    assert o["trained"] == len(trained)
    assert o["trained"] + o["dropped_stale"] + o["filtered"] + o["timed_out"] == out.valid, o
    assert o["timed_out"] == (G - 1) * len(out.partial_groups), o
    assert o["dropped_stale"] >= G * len(out.stale_groups), o
    assert "mismatch" not in o  # wrong group sizes are dead letters now (none here: every field is <bytes>)
    sources = {d.source for d in scenario.dlq}
    assert len(sources) == out.bad, "every undecodable record is in the DLQ (once per source offset)"
    assert all(d.reason and d.field == "<bytes>" for d in scenario.dlq)


def test_consumer_dlq_counter_counts_each_dead_letter_once(scenario):
    """Re-reads after a restart put a record in the DLQ topic again; the counter stays exact."""
    assert scenario.outcomes["dlq"] == scenario.feeder.out.bad
    assert len(scenario.dlq) >= scenario.feeder.out.bad


def _first_gated(audit: list[dict]) -> dict[str, int]:
    """rollout_id -> the step it was first gated at, by any incarnation (the gate runs at the
    step before the one its audit line names)."""
    first: dict[str, int] = {}
    for e in audit:
        for rid in e["trained"]:
            first.setdefault(rid, e["step"] - 1)
    return first


def _step_of(scenario):
    """version -> the step whose model it was, from the run files: each incarnation's first
    version is the model of the step it resumed at, and counts one version per step."""
    starts = sorted(zip(scenario.start_versions, scenario.start_steps))
    return lambda v: next(s + v - sv for sv, s in reversed(starts) if sv <= v)


def test_staleness_bound_holds_at_the_optimizer_step(scenario):
    """Staleness = the trainer's step at the optimizer step - the step whose model sampled the
    record (docs/algorithm.md; equal to the versions' difference until a crash renumbers the
    restored model), a record redone after a crash judged at the step it was first gated at."""
    versions, step_of = scenario.feeder.out.versions, _step_of(scenario)
    first = _first_gated(scenario.audit)
    worst = {s: max(first[r] - step_of(versions[r]) for r in e["trained"])
             for s, e in lineage_entries(scenario.ckpt).items()}
    assert max(worst.values()) <= MAX_STALENESS, {s: w for s, w in worst.items() if w > MAX_STALENESS}


def test_the_steps_lost_at_a_kill_are_trained_again_into_the_final_model(scenario):
    """Issue 24.2: every group a step trained, also a step a kill lost (it died before its
    checkpoint), is trained exactly once, whole, into the final model's lineage: none of them
    dropped as stale on the redo because the restored model's version ran ahead."""
    lineage = lineage_entries(scenario.ckpt)
    in_lineage = Counter(rid for e in lineage.values() for rid in e["trained"])
    lost = {rid for e in scenario.audit if lineage.get(e["step"]) != e for rid in e["trained"]}
    assert lost, "no kill lost a trained step: the scenario proves nothing"
    dropped = sorted(lost - set(in_lineage))
    where = {rid: [(e["step"], e["version"], e["run"]) for e in scenario.audit if rid in e["trained"]]
             for rid in dropped}
    assert not dropped, (f"{len(dropped)} of the {len(lost)} records of lost steps were not trained again: "
                         f"{[(scenario.feeder.out.versions[r], where[r]) for r in dropped]}; incarnations "
                         f"started at (step, version) {list(zip(scenario.start_steps, scenario.start_versions))}")
    assert set(in_lineage.values()) == {1}
    group_of = scenario.feeder.out.group_of
    assert set(Counter(group_of[rid] for rid in in_lineage).values()) == {G}  # whole groups, once


def test_versions_are_never_reused_and_producers_end_on_the_final_version(scenario):
    """Every announced version is new (announced again only with its durable copy: the same weights); a restart whose checkpoint is older than what
    the dead incarnation announced continues above it; the policy topic ends on the
    final model's version, which the producer stand-in (the feeder) follows."""
    versions = announced_versions(scenario.announced)  # again only for the same weights (durable copy)
    assert versions == sorted(versions), f"a version number was reused: {versions}"
    for k, start in zip(scenario.kills, scenario.start_versions[1:]):
        assert start >= k["announced"], (k, start)
        if k["committed_version"] < k["announced"]:
            assert start > k["announced"], (k, start)
    final = committed_checkpoint(scenario.ckpt)
    assert final.version == scenario.final_version == versions[-1] == latest_policy(scenario.kafka).version
    assert scenario.feeder.version_of() == final.version
    lineage = lineage_entries(scenario.ckpt)
    assert [lineage[s]["version"] for s in sorted(lineage)] == sorted({e["version"] for e in lineage.values()})
