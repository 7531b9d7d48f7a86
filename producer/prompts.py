"""Prompt sources for the producer: an endless, seeded stream of `Prompt`s.

`open_prompt_source(settings, kafka)` builds the source `producer.prompts`
names (a tagged union in common/config/producer.py: `type: jsonl | kafka_topic |
reasoning_gym`).

`JsonlPromptSource(path, seed)` reads a JSONL file of `{"prompt": ..., "answer": ...}`
lines (the format common/tasks/arithmetic.py writes), validates every line up front (a
bad file fails at startup, naming the line), and then cycles over it epoch
after epoch, reshuffling each epoch with a generator seeded by (seed, epoch):
the order is reproducible and independent of how far a previous run got.

`KafkaPromptSource(kafka, topic, group_id)` reads the same JSON objects, one per
Kafka message, from a prompt topic (`producer.prompts.topic`) that several
producers share through one consumer group (`producer.prompts.group_id`); a malformed message goes to the dead-letter
topic with its reason. Both offer `take(timeout_s) -> Prompt | None`, the
non-blocking call the service loop uses (a Kafka topic may be empty for a
while; the engine keeps stepping meanwhile).

`GymPromptSource(settings)` generates prompts from a reasoning-gym dataset
(common/tasks/reasoning_gym.py): it cycles over the training index range like the JSONL
source over its lines (reshuffled each epoch with `seed`) and never serves a
held-out prompt.

Every source binds each prompt's score here, once: a `Prompt` carries its
`Task(prompt, reference, score)` (common/tasks/task.py). A reasoning-gym
prompt is scored by the dataset's own function (with `reward: verifier`, by
`producer.verifier` on its answer); a JSONL or Kafka prompt by the source's
`verifier` (`producer.verifier`; exact_match, the config's default, when none
is given). Nothing downstream looks a verifier up.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlstream.common import metrics
from rlstream.common.config import JsonlPrompts, KafkaSettings, KafkaTopicPrompts, ReasoningGymPrompts
from rlstream.common.errors import ConfigError
from rlstream.common.kafka.client import make_consumer
from rlstream.common.kafka.dlq import DeadLetterWriter
from rlstream.common.tasks.reasoning_gym import GymTask
from rlstream.common.tasks.task import Task
from rlstream.common.tasks.verifiers import exact_match

Verifier = Callable[[str, str], "tuple[float, dict]"]

_BAD_PROMPTS = metrics.counter("rlstream_producer_bad_prompts_total",
                               "Malformed prompt-topic messages sent to the DLQ")


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    """Stable id: the row's "id" field if present, else "<file name>:<line number>"."""
    task: Task
    """The prompt text, its reference answer and its score, bound by the source."""
    epoch: int


class PromptSource(Protocol):
    """What the service loop needs: the next prompt without blocking for long."""

    def take(self, timeout_s: float = 0.0) -> Prompt | None:
        """The next prompt, or None if none is available now (or none remain)."""

    def close(self) -> None: ...


def open_prompt_source(settings: JsonlPrompts | KafkaTopicPrompts | ReasoningGymPrompts, kafka: KafkaSettings,
                       verifier: Verifier | None = None) -> PromptSource:
    """The source `producer.prompts` names; a bad JSONL file or reasoning-gym
    setting fails here, naming the line or the key. `verifier`: `producer.verifier`,
    what the source binds as its prompts' score (a reasoning-gym source only with
    `reward: verifier`)."""
    if settings.type == "kafka_topic":
        return KafkaPromptSource(kafka, settings.topic, group_id=settings.group_id, verifier=verifier)
    if settings.type == "reasoning_gym":
        return GymPromptSource(settings, verifier)
    return JsonlPromptSource(settings.path, seed=settings.seed, verifier=verifier)


def _default_verifier(verifier: Verifier | None) -> Verifier:
    return verifier or exact_match


class JsonlPromptSource:
    """Cycles over a JSONL prompt file, reshuffled every epoch with `seed`.

    `epochs=None` cycles forever; `start_epoch` resumes the order at an epoch.
    """

    def __init__(self, path: str | os.PathLike, seed: int = 0, epochs: int | None = None,
                 start_epoch: int = 0, shuffle: bool = True, verifier: Verifier | None = None):
        self.path = Path(path)
        self.verify = _default_verifier(verifier)
        self.seed = int(seed)
        self.epochs = epochs
        self.start_epoch = int(start_epoch)
        self.shuffle = shuffle
        self.rows = load_prompt_rows(self.path)

    def __len__(self) -> int:
        return len(self.rows)

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` yields them."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, timeout_s: float = 0.0) -> Prompt | None:
        """The next prompt (never None while epochs remain)."""
        if not hasattr(self, "_it"):
            self._it = iter(self)
        return next(self._it, None)

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[Prompt]:
        epoch = self.start_epoch
        while self.epochs is None or epoch < self.start_epoch + self.epochs:
            for i in self.epoch_order(epoch):
                pid, text, answer = self.rows[i]
                yield Prompt(pid, Task.checked_by(self.verify, text, answer), epoch)
            epoch += 1


class GymPromptSource:
    """Prompts generated by a reasoning-gym dataset, cycled over its training
    index range and reshuffled every epoch with `settings.seed`; held-out prompts
    are skipped. Each prompt's task is scored by the dataset (or by `verifier` on its
    answer, with `reward: verifier`)."""

    def __init__(self, settings: ReasoningGymPrompts, verifier: Verifier | None = None,
                 epochs: int | None = None):
        if settings.reward == "verifier" and verifier is None:
            raise ConfigError("reward: verifier needs producer.verifier", key="producer.prompts.reward")
        self.settings, self.verifier, self.epochs = settings, verifier, epochs
        self.task = GymTask(settings)
        self.split = self.task.split()
        if settings.reward == "verifier" and not self.task.item(self.split.train_start).answer:
            raise ConfigError(f"{self.task.name!r} items have no answer (only the dataset's scorer can judge "
                              "them): use reward: dataset", key="producer.prompts.reward")
        self._it: Iterator[Prompt] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` serves them (held-out prompts still in)."""
        start = self.split.train_start
        order = list(range(start, start + self.settings.size))
        random.Random(f"{self.settings.seed}:{epoch}").shuffle(order)
        return order

    def take(self, timeout_s: float = 0.0) -> Prompt | None:
        if self._it is None:
            self._it = iter(self)
        return next(self._it, None)

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[Prompt]:
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            served = 0
            for i in self.epoch_order(epoch):
                item = self.task.item(i)
                if item.prompt in self.split.heldout_prompts:
                    continue
                served += 1
                yield Prompt(f"{self.task.name}:{self.settings.dataset_seed}:{i}",
                             Task(item.prompt, item.answer, self._scorer(item)), epoch)
            if not served:
                raise ConfigError(f"every training prompt of {self.task.name!r} is also held out; raise size "
                                  "or lower heldout", key="producer.prompts.size")
            epoch += 1

    def _scorer(self, item) -> Callable[[str], tuple[float, dict]]:
        if self.settings.reward == "verifier":
            return lambda response: self.verifier(response, item.answer)
        return lambda response: self.task.score(response, item)


def parse_prompt_row(row, where: str, key: str = "producer.prompts.path") -> tuple[str, str, str]:
    """(prompt_id, prompt, answer) of one JSON object; ConfigError naming `where` (and `key`)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with 'prompt' and 'answer'", key=key)
    prompt, answer = row.get("prompt"), row.get("answer")
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string", key=key)
    if answer is None or isinstance(answer, (dict, list, bool)):
        raise ConfigError(f"{where}: 'answer' must be a string or a number", key=key)
    return (str(row["id"]) if "id" in row else where), prompt, str(answer)


class KafkaPromptSource:
    """Prompts from a Kafka topic, shared by every producer of a consumer group.

    Each message is `{"prompt": ..., "answer": ...[, "id": ...]}` (JSON, UTF-8).
    Offsets are committed automatically: a prompt taken by a producer that then
    crashes is not re-served (prompts are a stream to sample from, not records
    to account for). A malformed message is sent to the DLQ topic with a
    `rlstream-reason` header and counted; the service keeps running.
    """

    def __init__(self, kafka, topic: str, group_id: str = "rlstream-producers", verifier: Verifier | None = None):
        self.kafka, self.topic, self.verify = kafka, topic, _default_verifier(verifier)
        # a group join waits for the rebalance timeout (max_poll_interval_ms): keep it short
        self._consumer = make_consumer(
            kafka, topic, group_id=group_id, enable_auto_commit=True,
            auto_offset_reset="earliest", max_poll_interval_ms=5000, session_timeout_ms=6000,
            heartbeat_interval_ms=1000)
        self._dlq = DeadLetterWriter(kafka)
        self._buffer: list[Prompt] = []

    def take(self, timeout_s: float = 0.0) -> Prompt | None:
        if not self._buffer:
            for tp, msgs in self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=64).items():
                for m in msgs:
                    self._admit(m)
        return self._buffer.pop(0) if self._buffer else None

    def _admit(self, m) -> None:
        where = f"{m.topic}/{m.partition}/{m.offset}"
        try:
            pid, text, answer = parse_prompt_row(json.loads(m.value or b""), where, key="producer.prompts.topic")
        except (ValueError, ConfigError) as e:
            _BAD_PROMPTS.inc()
            self._dlq.send(m, "prompt", str(e))
            self._dlq.confirm()
            return
        self._buffer.append(Prompt(pid, Task.checked_by(self.verify, text, answer), 0))

    def close(self) -> None:
        self._consumer.close()
        self._dlq.close(timeout=10)


def load_prompt_rows(path: Path) -> list[tuple[str, str, str]]:
    """[(prompt_id, prompt, answer)] of every non-blank line; ConfigError naming the bad line."""
    if not path.is_file():
        raise ConfigError(f"prompt file {str(path)!r} does not exist; write one with "
                          "`python -m rlstream.common.tasks.arithmetic TRAIN HELDOUT`", key="producer.prompts.path")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg})", key="producer.prompts.path") from None
            pid, prompt, answer = parse_prompt_row(row, where)
            rows.append((pid if "id" in row else f"{path.name}:{lineno}", prompt, answer))
    if not rows:
        raise ConfigError(f"prompt file {str(path)!r} has no prompts", key="producer.prompts.path")
    return rows
