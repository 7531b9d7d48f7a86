"""The consumer's intake: what it refuses before a record reaches the ledger
(records that decode and validate, yet do not fit this consumer), and whether
records reach it at all (`IntakeWatch`, at the end).

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
import time
from typing import Callable

from rlstream.common import metrics
from rlstream.common.errors import InvalidRecordError
from rlstream.common.record import RecordLimits, Rollout

_STARVED = metrics.gauge("rlstream_consumer_intake_starved_seconds",
                         "Seconds the consumer's polls have returned no record while records waited on the broker, "
                         "with no train step (0 while records arrive or none wait; /readyz 503 beyond "
                         "consumer.liveness.intake_stall_after_s)")

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


class IntakeWatch:
    """Records wait on the broker, and the reader gets none of them: readiness says so.

    The consumer calls `read(n, lag)` after each poll of the reader (`n`: records
    the poll returned, valid or dead-lettered; `lag`: records on the broker past
    its positions) and `stepped()` after each train step. Starved: polls have
    returned nothing while records waited, with no step in between, for longer
    than `stall_after_s` (consumer.liveness.intake_stall_after_s). That is the
    broker not delivering (common/kafka/fetch_wait.py: a fetch wait at its cap
    on a log too long for it, a broker that stopped answering fetches), not a
    wedged loop: the loop polls on, so /healthz stays up and /readyz says why
    (`reasons`), with `rlstream_consumer_intake_starved_seconds`. Time between
    polls counts only while every poll in it came back empty: a long train
    step starts no clock. Thread-safe for the HTTP thread's reads.
    """

    def __init__(self, stall_after_s: float, topic: str = "", clock: Callable[[], float] = time.monotonic,
                 export: bool = True):
        self.stall_after_s, self.topic, self._clock = stall_after_s, topic, clock
        self._since: float | None = None  # first empty poll while records waited (None: not starved)
        self._lag = 0
        self.fetch_wait_ms: int | None = None
        """The reader's fetch wait, named in the reason (the service sets it)."""
        if export:
            _STARVED.set_function(self.starved_s)

    def read(self, n: int, lag: int) -> None:
        self._lag = lag
        if n > 0 or lag <= 0:
            self._since = None
        elif self._since is None:
            self._since = self._clock()

    def stepped(self) -> None:
        self._since = None

    def starved_s(self) -> float:
        since = self._since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def reasons(self) -> list[str]:
        """Readiness's check: [] unless starved for longer than the bound."""
        s = self.starved_s()
        if s <= self.stall_after_s:
            return []
        wait = f", fetch wait {self.fetch_wait_ms} ms" if self.fetch_wait_ms is not None else ""
        return [f"intake starved: {self._lag} records wait in {self.topic or 'the rollouts topic'} and polls of "
                f"the broker have returned none for {s:.0f} s, with no train step (intake_stall_after_s "
                f"{self.stall_after_s:g}{wait})"]
