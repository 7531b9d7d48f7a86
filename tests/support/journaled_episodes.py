"""Producers on the session's vLLM engine running multi-turn episodes with the journal on,
crashed and resumed in-process (tests/integration/test_episode_journal.py and the journal
tests beside it).

    Turns          the environment: an observation after every model turn until the third; replays
    config         a producer's config (id, journal on or off, lease 1 s)
    run_until      iterate a service until a condition holds, within a bound
    crash          what a SIGKILL leaves: engine requests aborted, lease stopped, clients closed
    journaled      the journal's live entries now (key -> Snapshot)
    resume_on_b    producer b takes a's entries and finishes a's groups
"""
from __future__ import annotations

import logging
import time

from rlstream.common.config import RlstreamConfig
from rlstream.common.lifecycle import close_attrs

G, TURNS = 4, 3
CLIENTS = ("driver", "publisher", "following", "prompts", "topic_ends", "_writer", "http")
"""ProducerService.close's, but the engine: the session's."""


class Turns:
    """Every model turn gets an observation until the third; reward 1. Replays (resumable)."""

    stop_texts = ()
    resumable = True

    def reset(self, task):
        self.n = 0
        return task.prompt

    def step(self, turn):
        from rlstream.common.tasks.environment import StepResult

        self.n += 1
        return StepResult(None, 1.0, True) if self.n >= TURNS else StepResult(f"={self.n},")


def config(kafka, model_dir, data, pid: str, journal: bool) -> RlstreamConfig:
    return RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 8},
        "producer": {"producer_id": pid, "group_size": G, "max_tokens": 6, "max_groups_in_flight": 2,
                     "prompts": {"type": "jsonl", "path": str(data)},
                     "episodes": {"env": "calculator", "max_turns": TURNS, "max_turn_tokens": 6,
                                  "max_episode_tokens": 40},
                     "journal": {"enabled": journal, "lease_s": 1.0}},
        "consumer": {"group_size": G, "groups_per_batch": 2}})


def run_until(svc, pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        svc.iterate()


def crash(svc, engine) -> None:
    """What a SIGKILL leaves: the engine's requests gone, no drain, no more writes."""
    engine.abort_all()
    for _ in range(100):
        if not engine.has_work():
            break
        engine.step()
    if svc.driver.runner.journal is not None:
        svc.driver.runner.journal._stop.set()  # the lease stops being renewed
    close_attrs(svc, CLIENTS, logging.getLogger("test"))


def journaled(kafka) -> dict:
    """The journal's live entries now: key -> Snapshot."""
    from rlstream.producer.journal.snapshot import decode
    from rlstream.producer.journal.topic import JournalTopic

    t = JournalTopic(kafka, lease_s=1.0)
    t.sync()
    out = {k: decode(v) for k, v in t.snapshots.items()}
    t.close()
    return out


def resume_on_b(broker, engine, cfg: RlstreamConfig, journal: bool, entries: int) -> float:
    """Producer b (`cfg`) takes a's `entries` journal entries (resumed, or found published in the
    rollouts topic) and finishes a's groups; the count of entries found published before it started."""
    from rlstream.common import metrics
    from rlstream.producer.service import ProducerService

    b = ProducerService(cfg, broker.bootstrap)
    b.start(engine=engine)
    try:
        taken = lambda: sum(metrics.value("rlstream_producer_resumed_episodes_total", outcome=o) or 0  # noqa: E731
                            for o in ("resumed", "published"))
        published = lambda: metrics.value("rlstream_producer_resumed_episodes_total", outcome="published") or 0  # noqa: E731
        taken0, published0 = taken(), published()
        done = lambda: taken() - taken0 >= entries and not any(  # noqa: E731
            g.startswith("a-") for g in b.groups._groups)
        t_off = time.monotonic() + 5  # without the journal: nothing to wait for
        run_until(b, lambda: done() if journal else time.monotonic() > t_off, 60, "a's episodes resumed")
        b.outbox.drain(timeout_s=30)
    finally:
        crash(b, engine)
    return published0
