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

__all__ = ["EpisodeJournal", "JournalTopic", "Resumer", "StalenessView", "open_journal"]


def open_journal(kafka, pcfg, runner, groups, verify, producer_id: str) -> Resumer:
    """The journal of `runner`'s episodes, started (lease, journal read to its end), and the
    Resumer that claims orphans into `runner` and `groups` (producer/rollout/__init__.py)."""
    from producer.envs import env_factory

    prompts = pcfg.prompts
    own_score = getattr(prompts, "type", "") == "reasoning_gym" and getattr(prompts, "reward", "") == "dataset"
    journal = EpisodeJournal(JournalTopic(kafka), producer_id, pcfg.journal, own_score=own_score)
    journal.start()
    runner.journal = journal
    return Resumer(journal, runner, groups, env_factory(pcfg.episodes), verify)
