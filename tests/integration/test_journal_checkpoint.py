"""A starting producer's journal read is bounded (producer/journal/checkpoint.py), on the broker.

The session broker is tansu, which never compacts: the journal keeps every write. A live
producer's claim pass writes a checkpoint of the live state once `checkpoint_every`
records have passed; a producer that starts afterwards folds that checkpoint and only the
records after it, and ends with the same live entries and leases as a reader of the whole
journal. A malformed checkpoint is refused (counted) and the reader reads from offset 0.
tests/bench/journal_start.py measures the start-up read time at 1x and 10x the history.
"""
from __future__ import annotations

import numpy as np
import pytest

from rlstream.common import metrics
from rlstream.common.config import JournalSettings
from tests.fixtures.kafka import make_kafka_settings

pytestmark = [pytest.mark.broker]
HISTORY, AFTER = 400, 20


def entry(i: int, holder: str = "w", incarnation: str = "i"):
    from rlstream.producer.journal.snapshot import Snapshot

    return Snapshot(group_id=f"w-1-{i}", sample_idx=0, group_size=1, owner="w", holder=holder,
                    incarnation=incarnation, rollout_id=f"{i:032d}", written_at=1.0, prompt_text="1+2=", answer="3",
                    own_score=False, prompt_ids=np.arange(1, 9, dtype=np.int32), response=np.zeros(0, np.int32),
                    mask=np.zeros(0, bool), logprobs=np.zeros(0, np.float32), versions=np.zeros(0, np.int64),
                    routing=None, num_experts=0, turns=0, reward=0.0)


def counting_topic(kafka):
    """A JournalTopic that counts the journal records it folds."""
    from rlstream.producer.journal.topic import JournalTopic

    class Counting(JournalTopic):
        n = 0

        def _fold(self, key, value, *rest):
            Counting.n += 1
            return super()._fold(key, value, *rest)

    return Counting(kafka, lease_s=1.0)


def started(kafka) -> tuple[object, int]:
    """A producer's journal, started as a producer starts it: (its topic, records it folded)."""
    from rlstream.producer.journal import EpisodeJournal

    topic = counting_topic(kafka)
    journal = EpisodeJournal(topic, "r", JournalSettings(lease_s=1.0))
    journal.start()
    journal._stop.set()  # no renewals: the view is what is compared
    return topic, type(topic).n


@pytest.mark.timeout(120)
def test_a_starting_producer_reads_the_newest_checkpoint_and_the_journal_after_it(broker, tmp_path):
    from rlstream.producer.journal import EpisodeJournal
    from rlstream.producer.journal.topic import JournalTopic

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs")
    w = EpisodeJournal(JournalTopic(kafka, lease_s=1.0), "w", JournalSettings(lease_s=1.0, checkpoint_every=50))
    w.start()
    try:
        for i in range(HISTORY // 2):  # a long history: episodes written, then ended
            w.topic.put(entry(i, "w", w.incarnation))
            if i >= 3:
                w.topic.tombstone(f"ep:w-1-{i}#0")
        w.topic.put(entry(HISTORY, "d", "dead"))  # an orphan (its holder never had a lease)
        w.topic.sync()
        written0 = metrics.value("rlstream_producer_journal_checkpoints_total") or 0
        w._next_claim = 0.0
        assert len(w.take(w.claim())) == 1  # the claim pass: w, the only live producer, writes the checkpoint
        assert (metrics.value("rlstream_producer_journal_checkpoints_total") or 0) - written0 == 1
        for i in range(HISTORY // 2, HISTORY // 2 + AFTER):
            w.topic.put(entry(i, "w", w.incarnation))
        w.topic.sync()
        w.topic.write_checkpoint()  # the newest: w's claim of the orphan is the last write of its key
        w.topic.checkpoints._producer.flush(10)

        topic, folded = started(kafka)
        assert folded <= AFTER + 20, f"{folded} journal records read at start"  # its lease and w's renewals
        whole = JournalTopic(kafka, lease_s=1.0)  # a reader of the whole journal, from offset 0
        whole.sync()
        assert sorted(topic.entries) == sorted(whole.entries) and len(topic.entries) == 3 + 1 + AFTER
        assert all(topic.snapshots[k] == whole.snapshots[k] and topic.offsets[k] == whole.offsets[k]
                   for k in topic.entries)
        assert topic.leases["w"].incarnation == w.incarnation
        claimed = topic.entries[f"ep:w-1-{HISTORY}#0"]
        assert (claimed.holder, claimed.epoch) == ("w", 1) == (whole.entries[claimed.key].holder, 1)
        for t in (topic, whole):
            t.close()

        refused0 = metrics.value("rlstream_producer_journal_refused_total", reason="checkpoint") or 0
        w.topic.checkpoints.write(b"not a checkpoint")
        w.topic.checkpoints._producer.flush(10)
        topic, folded = started(kafka)
        assert (metrics.value("rlstream_producer_journal_refused_total", reason="checkpoint") or 0) - refused0 == 1
        assert folded > HISTORY and len(topic.entries) == 3 + 1 + AFTER  # from offset 0, whole
        topic.close()
    finally:
        w.close()
