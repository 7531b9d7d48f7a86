"""A synthetic producer for consumer tests: a thread that publishes and remembers.

`SyntheticFeeder` publishes groups of tests/support/synthetic.py at a steady
rate (fresh, certainly stale, partial, or undecodable, by chance) and records
exactly what the broker acknowledged (`Published`): the ground truth that the
consumer's audit log and counters are checked against. `PolicyVersion` is the
newest version announced on the policy topic, as a producer follows it.
`flush_half_batch` empties the consumer's last, incomplete batch with fresh
fillers.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlstream.common.config import KafkaSettings
from rlstream.common.errors import PipelineError
from rlstream.harness.supervisor import Service, wait_until
from tests.support.audit import audit_lines, audit_steps
from tests.support.synthetic import publish_groups, synthetic_group


@dataclass
class Published:
    """What a SyntheticFeeder put on the topic (acknowledged by the broker)."""

    versions: dict[str, int] = field(default_factory=dict)  # rollout_id -> policy_version
    group_of: dict[str, str] = field(default_factory=dict)  # rollout_id -> group_id
    partial_groups: set[str] = field(default_factory=set)
    stale_groups: set[str] = field(default_factory=set)
    bad: int = 0

    @property
    def valid(self) -> int:
        return len(self.versions)


class SyntheticFeeder(threading.Thread):
    """Publishes synthetic groups (tests/support/synthetic.py) at about `rate_groups` per second.

    Each group is, by the configured fractions: complete and fresh (dispatch
    version = the newest announced version), complete and certainly stale
    (version 0, only once `stale_after` versions are committed), partial (G-1
    of G samples: a producer that died mid-group), or a raw invalid record.
    `hold()` pauses publishing (the consumer then waits in its fetch).
    """

    def __init__(self, kafka: KafkaSettings, G: int, *, seed: int = 0, rate_groups: float = 4.0,
                 p_partial: float = 0.1, p_stale: float = 0.15, p_bad: float = 0.05,
                 version_of=None, stale_after: int | None = None):
        super().__init__(name="synthetic-feeder", daemon=True)
        from rlstream.common.kafka.publisher import RolloutPublisher

        self.kafka, self.G = kafka, G
        self.rng = np.random.default_rng(seed)
        self.rate, self.p_partial, self.p_stale, self.p_bad = rate_groups, p_partial, p_stale, p_bad
        self.version_of = version_of or (lambda: 0)
        self.stale_after = stale_after
        self.pub = RolloutPublisher(kafka)
        self.out = Published()
        self._stop_ev, self._go = threading.Event(), threading.Event()
        self._go.set()
        self._seq = 0
        self.error: BaseException | None = None

    def hold(self) -> None:
        self._go.clear()

    def go(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop_ev.set()
        self._go.set()
        self.join(60)
        self.pub.close()

    def run(self) -> None:
        try:
            while not self._stop_ev.is_set():
                self._go.wait()
                if self._stop_ev.is_set():
                    break
                self.publish_one()
                self._stop_ev.wait(1.0 / self.rate)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.error = e

    def publish_one(self, kind: str | None = None) -> str:

        v_now = int(self.version_of())
        if kind is None:
            u = self.rng.random()
            stale_ok = self.stale_after is not None and v_now >= self.stale_after
            if u < self.p_bad:
                kind = "bad"
            elif u < self.p_bad + self.p_partial:
                kind = "partial"
            elif stale_ok and u < self.p_bad + self.p_partial + self.p_stale:
                kind = "stale"
            else:
                kind = "fresh"
        self._seq += 1
        gid = f"syn-{kind}-{self._seq}"
        if kind == "bad":
            self.pub.publish_bytes(gid.encode(), b"\x92\x01" + bytes(self.rng.integers(0, 256, 8, dtype=np.uint8)),
                                   timeout=60).result(timeout=60)
            self.out.bad += 1
            return kind
        group = synthetic_group(gid, self.G, 0 if kind == "stale" else v_now, self.rng)
        if kind == "partial":
            group = group[: self.G - 1]
            self.out.partial_groups.add(gid)
        if kind == "stale":
            self.out.stale_groups.add(gid)
        futs = [self.pub.publish(r, timeout=60) for r in group]
        for f in futs:
            f.result(timeout=60)
        for r in group:
            self.out.versions[r.rollout_id] = r.policy_version
            self.out.group_of[r.rollout_id] = gid
        return kind


class PolicyVersion:
    """Callable: the newest weights version announced on the policy topic (0: none),
    as a producer sees it (one ControlFollower per thread: Kafka clients are not
    thread-safe)."""

    def __init__(self, kafka: KafkaSettings):
        from rlstream.common.config import ControlSettings
        from rlstream.common.control.plane import ControlFollower

        self.follower = ControlFollower(kafka, ControlSettings())

    def __call__(self) -> int:
        self.follower.catch_up(timeout_s=10.0)
        w = self.follower.view.weights
        return 0 if w is None else w.version

    def close(self) -> None:
        self.follower.close()


def flush_half_batch(kafka: KafkaSettings, checkpoint_dir: Path, consumer: Service, G: int, B: int,
                     seed: int = 99, on_publish=None, version_of=None) -> None:
    """Publish fresh synthetic groups until a step takes the consumer's last, incomplete batch.

    Call it once the consumer read everything and holds no partial group: what it
    holds (`rlstream_consumer_held_records`) are then kept groups waiting for their
    batch, so B minus those fresh fillers complete it and one step takes them all
    (each filler is fresh, so kept). Should a held group be dropped as stale when
    gated, the step does not come: one more filler is published after 20 s without
    one, up to B more. `on_publish(rollouts)` sees every filler record;
    `version_of()` gives the fillers' version (default: the step count, which
    is the version while the consumer never restarted).
    """
    from rlstream.common.kafka.publisher import RolloutPublisher

    rng = np.random.default_rng(seed)
    waiting = int(consumer.try_metric("rlstream_consumer_held_records", 0) or 0) // G % B
    lines = audit_lines(checkpoint_dir)  # progress is a new audit line: a redo repeats step numbers
    with RolloutPublisher(kafka) as pub:
        for i in range(B - waiting + B):
            version = max(audit_steps(checkpoint_dir), default=0) if version_of is None else version_of()
            fill = synthetic_group(f"filler-{seed}-{i}", G, version, rng)
            publish_groups(pub, [fill])
            if on_publish is not None:
                on_publish(fill)
            if i < B - waiting - 1:
                continue  # the batch is not complete yet: no step to wait for
            try:
                wait_until(lambda: audit_lines(checkpoint_dir) > lines, 20 if i < 2 * B - waiting - 1 else 120,
                           "a step taking the fillers", [consumer])
                return
            except PipelineError:
                if i == 2 * B - waiting - 1:
                    raise
