"""Replay a run from the rollout log: `rlstream replay` (docs/log.md).

    record.py   what a trained step took, written into its audit line as `inputs`
                (schema-versioned): the records (topic, partition, offset), each
                sample's staleness, the control settings in force, the trainer
                settings' digest, the step's metrics
    lineage.py  which audit lines made a checkpoint's model, and the steps a replay runs
    fetch.py    the records of each step, read back by offset (claim checks resolved;
                a record or blob that is gone fails naming it)
    run.py      the replay: the start model (step 0 or a checkpoint), each step's
                batch rebuilt and trained with the consumer's own code, metrics and
                parameters compared with the original's

The consumer writes the records (consumer/service.py `train_step`); everything
else here only reads.
"""
from rlstream.common.errors import RlstreamError


class ReplayError(RlstreamError):
    """A replay cannot go on: a step record it cannot read, a record or blob that is gone,
    settings that differ from the run's. The message names what and says what to do."""
