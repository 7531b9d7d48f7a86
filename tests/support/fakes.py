"""Small stand-ins that several test files share.

    Clock        a clock that moves only when the test moves it (`clock.t += 10`)
    PickleBomb   an object whose unpickling creates a marker file: proof that something
                 unpickled it
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
