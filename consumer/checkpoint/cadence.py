"""Checkpoints on a cadence, written in the background after an in-memory snapshot.

    cadence = Cadence(cfg.consumer.checkpoint, step)   # every_steps / every_seconds
    if cadence.due(step):                              # after an optimizer step
        writes.wait()                                  # the previous write has committed
        snap = host_copy(trainer.state_dict())         # the loop blocks only for this copy
        writes.start(lambda: write_and_commit(snap))   # one write in flight, in a thread
        cadence.done(step)
    writes.wait()                                      # at shutdown

Why. A synchronous checkpoint after every step wrote model and optimizer
(about 248 GB per step at 30B-A3B on 8 shards, docs/trainer-scale.md) while
the GPUs idled. A crash now redoes the steps since the last checkpoint: the
ledger and reader offsets are committed with the model they produced
(consumer/stream/ledger.py), so the redone steps re-read their records and every
record is trained once in the lineage of the final model.

What a rank copies and how it is written in the background: writer.py.
"""
from __future__ import annotations

import time
from typing import Callable

from rlstream.common.config import CheckpointSettings


class Cadence:
    """Whether a checkpoint is due after a step: `every_steps` steps or
    `every_seconds` seconds since the last one (0 turns a trigger off)."""

    def __init__(self, settings: CheckpointSettings, step: int = 0, clock: Callable[[], float] = time.monotonic):
        self.settings, self.clock = settings, clock
        self.last_step, self.last_at = step, clock()

    def dirty(self, step: int) -> bool:
        """Steps were trained since the last checkpoint."""
        return step > self.last_step

    def due(self, step: int) -> bool:
        s = self.settings
        by_steps = s.every_steps > 0 and step - self.last_step >= s.every_steps
        by_time = s.every_seconds > 0 and self.clock() - self.last_at >= s.every_seconds
        return self.dirty(step) and (by_steps or by_time)

    def done(self, step: int) -> None:
        self.last_step, self.last_at = step, self.clock()
