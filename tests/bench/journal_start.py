"""A starting producer's journal read after 1x and 10x the history (producer/journal/checkpoint.py).

    .venv/bin/python tests/bench/journal_start.py            # 5,000 and 50,000 records, 3 starts each (~2-4 min)
    .venv/bin/python tests/bench/journal_start.py --smoke    # 300 and 3,000 records, 1 start each

The bundled broker (tansu, memory storage) never compacts, so the journal keeps every
write ever made. A writer producer (its own journal, lease 2 s) runs episodes into the
journal: each episode writes one entry per turn (`--turns`, a few KB each on the tiny
model's shapes: prompt, response and routing rows so far) and is tombstoned at its end,
`--live` of them unfinished at any time; its claim pass runs every 500 records, as a
producer's loop would, and writes a checkpoint each `--checkpoint-every` records. After
`--history` records, and again after 10x, the newest checkpoint is `--tail` records old
(default half of checkpoint_every: a start at a random moment reads that many on
average, at most checkpoint_every), and a fresh producer starts (EpisodeJournal.start:
its lease, the newest checkpoint, the journal after it, read past its own lease) `--reps`
times; and a reader that ignores checkpoints (what every start did before them) starts as
reference. Each start must end with the writer's live entries.

Prints ONE JSON object:
    start_read_s               {"1x": s, "10x": s}: median start-up read time with checkpoints
    ratio_10x_over_1x          goal: flat (~1; the read is one checkpoint plus < checkpoint_every records)
    records_read               {"1x": n, "10x": n}: journal records the start read (after the checkpoint it loaded:
                               the tail, its own lease and the writer's renewals)
    without_checkpoints        the same two figures reading from offset 0 (the history's cost)
    history_records            {"1x": n, "10x": n}: records in the journal when the start ran
    checkpoints_written, checkpoint_every, tail_records, live_entries, entry_bytes, smoke
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

SMOKE = dict(history=300, checkpoint_every=100, tail=50, reps=1, live=8)


def entry(episode: int, turn: int, holder: str, incarnation: str, rng):
    """Episode `episode`'s entry after `turn` turns: tiny-model shapes (2 layers, top-2 of 8 experts)."""
    from rlstream.producer.journal.snapshot import Snapshot

    P, T = 32, 12 * turn
    return Snapshot(
        group_id=f"w-bench-{episode // 4}", sample_idx=episode % 4, group_size=4, owner=holder, holder=holder,
        incarnation=incarnation, rollout_id=f"{episode:032x}", written_at=time.time(), prompt_text="12+34-5=",
        answer="41", own_score=False, prompt_ids=rng.integers(1, 64, P, dtype=np.int32),
        response=rng.integers(1, 64, T, dtype=np.int32), mask=np.ones(T, bool),
        logprobs=-rng.random(T).astype(np.float32), versions=np.zeros(T, np.int64),
        routing=rng.integers(0, 8, (P + T - 1, 2, 2)).astype(np.uint8) if T else None, num_experts=8 if T else 0,
        turns=turn, reward=0.0)


class Writer:
    """The writing producer: episodes of `turns` turns, `live` at a time, into its journal."""

    def __init__(self, kafka, live: int, turns: int, checkpoint_every: int):
        from rlstream.common.config import JournalSettings
        from rlstream.producer.journal import EpisodeJournal
        from rlstream.producer.journal.topic import JournalTopic

        self.journal = EpisodeJournal(JournalTopic(kafka, lease_s=2.0), "w",
                                      JournalSettings(lease_s=2.0, checkpoint_every=checkpoint_every))
        self.journal.start()
        self.rng, self.turns, self.records, self.next = np.random.default_rng(0), turns, 0, live
        self.running = {e: 0 for e in range(live)}  # episode -> turns written
        self.entry_bytes: list[int] = []

    def write(self, n: int, passes: bool = True) -> None:
        """`n` journal records; with `passes`, a claim pass every 500 and one at the end."""
        from rlstream.producer.journal.snapshot import encode, episode_key

        topic = self.journal.topic
        for _ in range(n):
            e = min(self.running, key=self.running.get)  # the episode furthest behind
            if self.running[e] >= self.turns:
                topic.tombstone(episode_key(f"w-bench-{e // 4}", e % 4))
                del self.running[e]
                self.running[self.next], self.next = 0, self.next + 1
            else:
                s = entry(e, self.running[e], "w", self.journal.incarnation, self.rng)
                if len(self.entry_bytes) < 64:
                    self.entry_bytes.append(len(encode(s)))
                topic.put(s)
                self.running[e] += 1
            self.records += 1
            if passes and self.records % 500 == 0:
                self.claim_pass()
        if passes:
            self.claim_pass()
        self.journal.topic.sync(timeout_s=120)

    def claim_pass(self) -> None:
        self.journal.topic.sync(timeout_s=120)
        self.journal._next_claim = 0.0
        self.journal.claim()  # the writer is the only live producer: it writes the checkpoints


def start(kafka, checkpoints: bool) -> tuple[float, int, int]:
    """(seconds, journal records read, live entries) of one producer's start."""
    from rlstream.common.config import JournalSettings
    from rlstream.producer.journal import EpisodeJournal
    from rlstream.producer.journal.topic import JournalTopic

    class Counting(JournalTopic):
        def _fold_message(self, m):
            self.n += 1
            return super()._fold_message(m)

    topic = Counting.__new__(Counting)
    topic.n = 0
    Counting.__init__(topic, kafka, lease_s=2.0)
    if not checkpoints:
        topic.checkpoints.newest = lambda *a, **kw: None
    journal = EpisodeJournal(topic, f"r{time.monotonic_ns()}", JournalSettings(lease_s=2.0))
    t0 = time.perf_counter()
    journal.start()
    seconds = time.perf_counter() - t0
    live = sum(1 for e in topic.entries.values() if e.holder == "w")
    journal.close()
    return seconds, topic.n, live


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=5000, help="journal records of the 1x history (10x: ten times)")
    ap.add_argument("--checkpoint-every", type=int, default=5000)
    ap.add_argument("--tail", type=int, default=None, help="records after the newest checkpoint when a producer "
                    "starts (default: half of --checkpoint-every)")
    ap.add_argument("--live", type=int, default=32, help="unfinished episodes at any time")
    ap.add_argument("--turns", type=int, default=8, help="turns (journal entries) per episode")
    ap.add_argument("--reps", type=int, default=3, help="starts per history size (the median is reported)")
    args = parse_args(ap, SMOKE, argv)

    from rlstream.common import metrics
    from rlstream.common.config import BrokerSettings
    from rlstream.common.kafka.broker import EmbeddedBroker
    from tests.fixtures.kafka import make_kafka_settings

    broker = EmbeddedBroker(BrokerSettings(port=0)).start()
    out: dict = {"start_read_s": {}, "records_read": {}, "history_records": {}, "tail_records": args.tail,
                 "without_checkpoints": {"start_read_s": {}, "records_read": {}},
                 "checkpoint_every": args.checkpoint_every, "live_entries": args.live, "smoke": args.smoke}
    try:
        with tempfile.TemporaryDirectory() as blobs:
            kafka = make_kafka_settings(broker.bootstrap, blobs)
            writer = Writer(kafka, args.live, args.turns, args.checkpoint_every)
            tail = out["tail_records"] = args.checkpoint_every // 2 if args.tail is None else args.tail
            for size, total in (("1x", args.history), ("10x", 10 * args.history)):
                writer.write(total - tail - writer.records)
                writer.journal.topic.write_checkpoint()  # the newest checkpoint, `tail` records before the start
                writer.write(tail, passes=False)
                runs = [start(kafka, True) for _ in range(args.reps)]
                bare = start(kafka, False)
                live = sum(1 for turns in writer.running.values() if turns)  # episodes with an entry
                assert all(n == live for _, _, n in [*runs, bare]), (live, runs, bare)
                out["start_read_s"][size] = round(statistics.median(s for s, _, _ in runs), 4)
                out["records_read"][size] = int(statistics.median(n for _, n, _ in runs))
                out["without_checkpoints"]["start_read_s"][size] = round(bare[0], 4)
                out["without_checkpoints"]["records_read"][size] = bare[1]
                out["history_records"][size] = writer.records
            writer.journal.close()
    finally:
        broker.stop()
    out["ratio_10x_over_1x"] = round(out["start_read_s"]["10x"] / out["start_read_s"]["1x"], 3)
    out["without_checkpoints"]["ratio_10x_over_1x"] = round(
        out["without_checkpoints"]["start_read_s"]["10x"] / out["without_checkpoints"]["start_read_s"]["1x"], 3)
    out["checkpoints_written"] = int(metrics.value("rlstream_producer_journal_checkpoints_total") or 0)
    out["entry_bytes"] = int(statistics.median(writer.entry_bytes))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
