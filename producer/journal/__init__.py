"""Durable partial episodes (docs/multi-turn.md "Durable episodes").

With `producer.episodes` and `producer.journal.enabled`, each unfinished episode's
state is written after every completed turn to a compacted topic keyed by episode
(`snapshot.py` the format and its checks, `topic.py` the topic and its fold), and
tombstoned once its record is acknowledged. A producer that starts (from the newest
checkpoint of the live state: `checkpoint.py`), or sees a peer's lease lapse, claims the
orphaned episodes (`claims.py`; the first claim in the journal wins, at the next claim
epoch, with times judged by the reader's clock within a bounded skew), refuses those
the record schema would refuse, skips those whose record is already in the rollouts
topic (`published.py`) and resumes the others from their last durable turn
(`resume.py`). A producer whose episodes a peer took over stops them (fenced).
`journal.py` is the one object the runner and the service call.
"""
from rlstream.common.tasks.envs import env_factory
from rlstream.producer.journal.journal import EpisodeJournal
from rlstream.producer.journal.published import published
from rlstream.producer.journal.resume import Resumer, StalenessView
from rlstream.producer.journal.topic import JournalTopic

__all__ = ["EpisodeJournal", "JournalTopic", "Resumer", "StalenessView", "open_journal"]


def open_journal(kafka, pcfg, runner, groups, verify, producer_id: str, rollout_ends=dict) -> Resumer:
    """The journal of `runner`'s episodes, started (lease, journal read to its end), and the
    Resumer that claims orphans into `runner` and `groups` (producer/rollout/build.py).
    `rollout_ends`: the rollouts topic's end offsets as the service knows them (a lower bound)."""
    prompts = pcfg.prompts
    own_score = getattr(prompts, "type", "") == "reasoning_gym" and getattr(prompts, "reward", "") == "dataset"
    journal = EpisodeJournal(JournalTopic(kafka, pcfg.journal.lease_s), producer_id, pcfg.journal, own_score=own_score,
                             rollout_ends=rollout_ends, published=lambda wanted: published(kafka, wanted))
    journal.start()
    runner.journal = journal
    return Resumer(journal, runner, groups, env_factory(pcfg.episodes), verify)
