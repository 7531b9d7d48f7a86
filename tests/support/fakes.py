"""Small stand-ins that several test files share.

    Clock        a clock that moves only when the test moves it (`clock.t += 10`)
    PickleBomb   an object whose unpickling creates a marker file: proof that something
                 unpickled it
    FakeChannel  a weight link's command channel (common/weights/link.py Channel) in memory:
                 the trainer's commands posted, the producer's acks recorded
"""
from __future__ import annotations

import os
from pathlib import Path


class Clock:
    """A monotonic clock for code that takes one as a callable: `t` seconds until the test changes it."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class PickleBomb:
    """Unpickling this runs `touch marker`: the marker file exists once anything unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class FakeChannel:
    """common/weights/link.py Channel: commands posted by the trainer, acks recorded."""

    link = 1

    def __init__(self):
        self.commands: list[dict] = []
        self.acks: dict[int, dict] = {}
        self._seen = 0

    def post(self, op: str, **args) -> None:
        self.commands.append({"op": op, **args})

    def next_command(self):
        if self._seen == len(self.commands):
            return None
        k, self._seen = self._seen, self._seen + 1
        return k, self.commands[k]

    def ack(self, k: int, **result) -> None:
        self.acks[k] = result
