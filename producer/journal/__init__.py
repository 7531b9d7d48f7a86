"""Durable partial episodes (docs/multi-turn.md "Durable episodes").

With `producer.episodes` and `producer.journal.enabled`, each unfinished episode's
state is written after every completed turn to a compacted topic keyed by episode
(`snapshot.py` the format, `topic.py` the topic), and tombstoned once its record is
acknowledged. A producer that starts, or sees a peer's lease lapse, claims the orphaned
episodes (`claims.py`) and resumes them from their last durable turn (`resume.py`).
`journal.py` is the one object the runner and the service call.
"""
from producer.journal.journal import EpisodeJournal
from producer.journal.resume import Resumer, StalenessView
from producer.journal.topic import JournalTopic

__all__ = ["EpisodeJournal", "JournalTopic", "Resumer", "StalenessView"]
