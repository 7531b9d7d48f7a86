"""What the consumer refuses before a record reaches the ledger: records that
decode and validate, yet do not fit this consumer.

The reader (common/kafka/reader.py) applies both parts to every record and
sends a refused one to the DLQ with its reason and field, counted like any
other dead letter (`rlstream_dlq_records_total{field}`, outcome `dlq`):

- `record_limits(dims, group_size)`: the model's vocabulary, MoE layers,
  top-k and experts (a record that does not fit would crash the training
  forward), P + T at most the model's `max_position_embeddings` (a longer
  sequence is beyond what the model was built for and costs the step far more
  than one sample is worth), and `consumer.group_size` (a record of another G
  can never complete a group).
- `VersionBound`: no policy or token version above the newest version this
  pipeline announced. Such a record would be trained with staleness 0 whatever
  its real age, so a buggy or hostile producer could bypass the staleness gate.

The slack. Producers only ever serve versions the consumer announced (a
weight version exists only once the consumer wrote and announced it), and the
consumer knows the newest of them: its own version (announcements follow the
checkpoint that produced them) or, after a restore from an older checkpoint,
the newest `WeightsReady` on the policy topic, which its control follower
reads to the end at start. So a legitimate record is never above that bound
and `FUTURE_VERSION_SLACK` is 0. It exists for a deployment that must
tolerate a lagging view (e.g. a policy topic read from a lagging replica).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from common.errors import InvalidRecordError
from common.record import RecordLimits, Rollout

FUTURE_VERSION_SLACK = 0
"""Versions above the newest announced one that a record may still carry (see the module docstring)."""


def record_limits(dims, group_size: int) -> RecordLimits:
    """The limits a record must meet to be trained by this consumer (dims: consumer.model.HFModelDims)."""
    limits = RecordLimits.for_model(dims.vocab_size, dims.num_layers, dims.topk, dims.num_experts,
                                    positions=dims.max_position_embeddings)
    return dataclasses.replace(limits, group_size=group_size)


class VersionBound:
    """The reader's `check`: refuses versions above `newest() + slack`.

    `newest()` is called once per record: it must be cheap (the service's
    version and its follower's newest announcement).
    """

    def __init__(self, newest: Callable[[], int], slack: int = FUTURE_VERSION_SLACK):
        self.newest, self.slack = newest, slack

    def __call__(self, r: Rollout) -> None:
        bound = self.newest() + self.slack
        if r.policy_version > bound:
            raise InvalidRecordError("policy_version", self._why(r.policy_version, bound))
        tv = r.token_versions
        if tv is not None and len(tv) and int(tv[:, 0].max()) > bound:
            raise InvalidRecordError("token_versions", self._why(int(tv[:, 0].max()), bound))

    def _why(self, version: int, bound: int) -> str:
        return (f"version {version} is from the future: the newest announced version is {bound - self.slack} "
                f"(slack {self.slack}); it would bypass the staleness gate")
