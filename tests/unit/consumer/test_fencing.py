"""Fenced copies (consumer/stream/assembler.py "Fencing"): a rollout id is trained only from its
newest journal claim epoch; an older epoch's copy goes to the DLQ (field claim_epoch),
also when it was held first; every record read still ends in exactly one outcome.
tests/integration/test_journal_fencing.py runs it end to end on the cluster twin."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlstream.common.errors import InvalidRecordError
from rlstream.common.kafka.reader import ReadItem as Item
from rlstream.common.record import Rollout, decode, encode
from rlstream.consumer.stream.assembler import GroupAssembler
from rlstream.consumer.stream.ledger import Ledger
from tests.support.ledger_records import G, copy, read_all


def epoch(r: Rollout, e: int) -> Rollout:
    return dataclasses.replace(r, claim_epoch=e)


def ledger() -> Ledger:
    return Ledger(GroupAssembler(G, timeout_s=10.0))


def balanced(led: Ledger, read: int) -> bool:
    return sum(led.counters.values()) + led.held_records() == read


def test_a_copy_from_an_older_claim_is_fenced_after_the_newer_one():
    led = ledger()
    group = copy("g", "a")
    zombie = epoch(group[1], 0)
    read_all(led, [epoch(group[0], 0), epoch(group[1], 1), zombie, *group[2:]])
    (it, why), = led.take_fenced()
    assert it.rollout is zombie and "claim epoch 0" in why and "epoch 1" in why and not led.take_refused()
    assert [r.claim_epoch for r in led.complete[0].rollouts()] == [0, 1, 0, 0]
    assert led.counters["dlq"] == 1 and led.counters["duplicate"] == 0 and balanced(led, G + 1)


def test_a_newer_claims_copy_replaces_an_older_one_still_held_and_the_older_is_fenced():
    led = ledger()
    group = copy("g", "a")
    read_all(led, [group[0], group[1]])  # epoch 0: the zombie's copy came first
    newer = epoch(group[1], 1)
    read_all(led, [newer, *group[2:]], start=2)
    (it, why), = led.take_fenced()
    assert (it.partition, it.offset) == (0, 1) and "superseded by epoch 1" in why
    assert led.complete[0].rollouts()[1] is newer and led.counters["dlq"] == 1 and balanced(led, G + 1)
    read_all(led, [group[1]], start=G + 1)  # a retry of the fenced copy, later: fenced again
    assert len(led.take_fenced()) == 1 and balanced(led, G + 2)


def test_a_newer_copy_after_the_older_ones_group_completed_is_a_duplicate_trained_once():
    led = ledger()
    group = copy("g", "a")
    read_all(led, group)
    read_all(led, [epoch(group[1], 1)], start=G)
    assert len(led.complete) == 1 and led.counters["duplicate"] == 1 and not led.take_fenced()


def test_after_a_restart_a_copy_of_a_checkpointed_id_is_a_duplicate_whatever_its_epoch():
    asm = GroupAssembler(G, timeout_s=10.0)
    asm.mark_seen(["a/g/1"])
    r = copy("g", "a")[1]
    assert asm.add(epoch(r, 0), 0, 9).outcome == "duplicate" and asm.add(epoch(r, 3), 0, 10).outcome == "duplicate"


def test_the_claim_epoch_travels_only_when_set_and_is_validated():
    r = copy("g", "a")[0]
    assert encode(r) == encode(epoch(r, 0)) and b"claim_epoch" not in encode(r)  # other records byte-identical
    assert decode(encode(epoch(r, 7))).claim_epoch == 7 and decode(encode(r)).claim_epoch == 0
    for bad in (-1, 2**31, True):
        with pytest.raises(InvalidRecordError, match="claim_epoch"):
            encode(epoch(r, bad))
    assert Item(0, 0, r).rollout.claim_epoch == 0 and np.array_equal(decode(encode(r)).prompt_ids, r.prompt_ids)
