"""run_rl's watch loop evaluates on its own schedule, not on the progress-tick grid.

With progress every 5 s and evaluations every 15 s, a loop that only looks at
the clock on ticks evaluates every 20 s (the first tick at or past 15 s after
the last evaluation's start, ticks drifting by the time scrapes and scoring
take); the demo's two-in-a-row stop rule then waits up to 40 s instead of 30 s
to confirm. A fake clock drives the loop (no services)."""
from types import SimpleNamespace

from rlstream.harness import observe, runs
from rlstream.harness.runs import RunResult, StopRule, _watch


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


class Evaluator:
    """VersionEvaluator's schedule, a new version every time it is asked."""

    def __init__(self, clock):
        self.clock, self.last_at, self.at, self.version = clock, clock.now, [], 0

    def seconds_until_due(self, interval):
        return self.last_at + interval - self.clock.now

    def due(self, interval):
        return self.seconds_until_due(interval) <= 0

    def evaluate_newest(self):
        self.last_at = self.clock.now
        self.at.append(self.clock.now)
        self.clock.sleep(1.0)  # scoring takes a second
        self.version += 1
        return self.version, {"accuracy": 0.1, "greedy": 0.1, "metric": "avg@8", "seconds": 0.0}


def test_evaluations_come_every_eval_every_s(monkeypatch):
    clock = Clock()
    fake_time = SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep)
    monkeypatch.setattr(runs, "time", fake_time)
    monkeypatch.setattr(observe, "time", fake_time)
    monkeypatch.setattr(observe.Observer, "__init__", lambda self: (setattr(self, "t0", clock.now),
                                                                     setattr(self, "prev", {}))[0])
    pipe = SimpleNamespace(check_alive=lambda: None, scrape_all=lambda: clock.sleep(0.2) or {})  # a scrape: 0.2 s
    ev = Evaluator(clock)
    _watch(pipe, ev, StopRule(max_seconds=90.0), [], RunResult("t", "-", 0.1), tick_s=5.0, eval_every_s=15.0)
    gaps = [round(b - a, 6) for a, b in zip([1000.0] + ev.at, ev.at)]
    assert len(gaps) >= 5 and all(15.0 <= g <= 15.5 for g in gaps), gaps  # on the tick grid: 16.4-21 s
