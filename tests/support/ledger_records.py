"""Rollout records fed straight into a consumer Ledger, no broker (the assembler and ledger
unit tests).

    rollout    one valid record of group `group`, slot `idx`, from `producer`
    copy       a producer's copy of a group: its records in the given slots
    read_all   the ledger reads the records as consecutive offsets of partition 0
"""
from __future__ import annotations

import numpy as np

from rlstream.common.kafka.reader import ReadItem as Item
from rlstream.common.record import Rollout
from rlstream.consumer.stream.ledger import Ledger

G = 4
"""Samples per group."""


def rollout(group: str, idx: int, producer: str = "p", rid: str | None = None) -> Rollout:
    return Rollout(rollout_id=rid or f"{producer}/{group}/{idx}", group_id=group, sample_idx=idx, group_size=G,
                   prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3], np.int32),
                   logprobs=np.array([-0.5], np.float32), policy_version=0, reward=float(idx % 2),
                   producer_id=producer)


def copy(group: str, producer: str, slots=range(G)) -> list[Rollout]:
    return [rollout(group, i, producer) for i in slots]


def read_all(ledger: Ledger, records: list[Rollout], start: int = 0) -> None:
    ledger.read([Item(0, start + o, r) for o, r in enumerate(records)])
