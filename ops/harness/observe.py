"""Watching services from outside: HTTP, Prometheus scrapes, progress rows.

- `http_request` / `healthy`: one request to a service (its address comes
  from its run file, ops/harness/supervisor.py).
- `scrape` / `parse`: a /metrics exposition as `Metrics`, {(name, sorted
  labels): value}. `metric` looks up one sample with exactly these labels;
  `total` (and `metric_value`, on exposition text) sums the samples whose
  labels include the given ones (e.g. every outcome of a counter).
- `quiesce`: wait until the consumer has read everything and its outcome
  counters stopped moving (before it is stopped, so that nothing is unread).
- `Observer`: successive scrapes of a run's services turned into progress
  rows (interval rates, last-step trainer metrics, cumulative phase timings),
  the rows the demo prints and ops/harness/report.py plots.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol

from rlstream.consumer.stream.ledger import OUTCOMES

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Running(Protocol):
    """What `quiesce` reads of a running service (a supervisor.Service)."""

    url: str | None

    @property
    def alive(self) -> bool: ...


# ---------------------------------------------------------------------------- http

def http_request(url: str, method: str = "GET", body: dict | bytes | None = None,
                 token: str | None = None, headers: dict | None = None,
                 timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of one request; HTTP errors are answers, not exceptions
    (OSError when nothing answers). A dict body is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """True iff `url`/healthz answers 200."""
    try:
        return http_request(url + "/healthz", timeout=timeout_s)[0] == 200
    except OSError:
        return False


# ---------------------------------------------------------------------------- metrics

def parse(text: str) -> Metrics:
    """Prometheus exposition text as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Metrics = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, timeout_s: float = 3.0) -> Metrics | None:
    """The samples of `url`/metrics; None if the service does not answer."""
    try:
        code, body = http_request(url + "/metrics", timeout=timeout_s)
    except OSError:
        return None
    return parse(body.decode()) if code == 200 else None


def metric(m: Metrics | None, metric_name: str, default: float = 0.0, **labels) -> float:
    """The sample `metric_name` with exactly `labels`; `default` when absent."""
    if not m:
        return default
    return m.get((metric_name, tuple(sorted(labels.items()))), default)


def total(m: Metrics | None, metric_name: str, **labels) -> float:
    """Sum of the samples `metric_name` whose labels include `labels` (0 if none)."""
    want = labels.items()
    return sum(v for (n, lab), v in (m or {}).items() if n == metric_name and want <= dict(lab).items())


def metric_value(text: str, metric_name: str, **labels) -> float:
    """`total` of an exposition text."""
    return total(parse(text), metric_name, **labels)


def quiesce(consumer: Running, timeout_s: float = 60.0, settle_s: float = 3.0) -> tuple[Metrics | None, float]:
    """Wait until the consumer read everything (lag 0, no open group) and its
    outcome counters did not move for `settle_s`; (last scrape, seconds waited)."""
    t0 = time.monotonic()
    last, stable_since = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s and consumer.alive:
        m = scrape(consumer.url)
        counted = sum(metric(m, "rlstream_consumer_records_total", outcome=o) for o in OUTCOMES)
        done = (m is not None and metric(m, "rlstream_consumer_lag_records", 1) == 0
                and metric(m, "rlstream_consumer_open_groups", 1) == 0)
        if counted != last:
            last, stable_since = counted, time.monotonic()
        if done and time.monotonic() - stable_since > settle_s:
            return m, time.monotonic() - t0
        time.sleep(0.5)
    return (scrape(consumer.url) if consumer.url else None), time.monotonic() - t0


# ---------------------------------------------------------------------------- progress rows

@dataclass
class Observer:
    """Turns successive scrapes into progress rows (interval rates, last-step values)."""

    t0: float = field(default_factory=time.monotonic)
    prev: dict = field(default_factory=dict)

    def row(self, scrapes: dict[str, Metrics | None]) -> dict:
        now = time.monotonic()
        prods = [m for n, m in scrapes.items() if n.startswith("producer") and m]
        c = scrapes.get("consumer")
        cur = {
            "t": now,
            "samples": sum(metric(m, "rlstream_producer_samples_total") for m in prods),
            "reward_sum": sum(metric(m, "rlstream_producer_reward_sum") for m in prods),
            "trained": metric(c, "rlstream_consumer_records_total", outcome="trained"),
            "st_sum": metric(c, "rlstream_consumer_staleness_versions_sum"),
            "st_n": metric(c, "rlstream_consumer_staleness_versions_count"),
        }
        p = self.prev or {**cur, "t": self.t0, "samples": 0, "reward_sum": 0, "trained": 0, "st_sum": 0, "st_n": 0}
        dt = max(cur["t"] - p["t"], 1e-6)
        d = {k: cur[k] - p[k] for k in cur}
        self.prev = cur
        step = lambda name: metric(c, "rlstream_trainer_step_metric", float("nan"), name=name)  # noqa: E731
        return {
            "kind": "tick", "time": round(now - self.t0, 2),
            "version": int(metric(c, "rlstream_consumer_policy_version")),
            "reward_mean": d["reward_sum"] / d["samples"] if d["samples"] else None,
            "kl": _num(step("kl_train_inference")), "entropy": _num(step("entropy")),
            "clip_frac": _num(step("clip_frac")), "is_truncated_frac": _num(step("is_truncated_frac")),
            "ess": _num(step("ess")), "mismatch_kl": _num(step("mismatch_kl")), "grad_norm": _num(step("grad_norm")),
            "max_staleness": _num(metric(c, "rlstream_control_setting", float("nan"), key="max_staleness")),
            "by_staleness": _by_staleness(c),
            "staleness_mean": d["st_sum"] / d["st_n"] if d["st_n"] else None,
            "samples_per_s": d["trained"] / dt, "generated_per_s": d["samples"] / dt,
            "generated": int(d["samples"]),
            "producer_versions": [int(metric(m, "rlstream_producer_policy_version")) for m in prods],
            "outcomes": {o: int(metric(c, "rlstream_consumer_records_total", outcome=o)) for o in OUTCOMES},
            "lag": int(metric(c, "rlstream_consumer_lag_records")),
            "cum": _cumulative(c, prods),
        }


def _by_staleness(c: Metrics | None) -> dict:
    """The consumer's last-step signals per staleness bucket (`rlstream_trainer_signal`), buckets with tokens."""
    out: dict[str, dict] = {}
    for (name, labels), v in (c or {}).items():
        lab = dict(labels)
        if name == "rlstream_trainer_signal" and lab.get("staleness", "all") != "all" and v == v:
            out.setdefault(lab["staleness"], {})[lab["signal"]] = v
    return {b: sig for b, sig in out.items() if sig.get("token_share")}


def _cumulative(c: Metrics | None, prods: list[Metrics]) -> dict:
    """Cumulative timing counters (differences over an interval give per-phase means).

    Consumer: seconds and count of each global-step phase (wait/train/checkpoint/
    publish); producers: weight-reload seconds and count, generated tokens, engine
    tokens per engine-second (so tokens / rate = seconds the engine was stepping),
    and admission refusals by reason.
    """
    out = {}
    for ph in ("wait", "train", "checkpoint", "publish"):
        out[f"c_{ph}_s"] = metric(c, "rlstream_consumer_step_phase_seconds_sum", phase=ph)
        out[f"c_{ph}_n"] = metric(c, "rlstream_consumer_step_phase_seconds_count", phase=ph)
    out["p_reload_s"] = sum(metric(m, "rlstream_producer_weight_reload_seconds_sum") for m in prods)
    out["p_reload_n"] = sum(metric(m, "rlstream_producer_weight_reload_seconds_count") for m in prods)
    out["p_tokens"] = sum(metric(m, "rlstream_producer_tokens_total") for m in prods)
    out["p_engine_s"] = sum(metric(m, "rlstream_producer_tokens_total") / metric(m, "rlstream_producer_tokens_per_second")
                            for m in prods if metric(m, "rlstream_producer_tokens_per_second") > 0)
    for reason in ("staleness", "publish_buffer", "paused"):
        out[f"p_held_{reason}"] = sum(metric(m, "rlstream_producer_held_back_total", reason=reason) for m in prods)
    return out


def _num(x: float) -> float | None:
    return None if x != x else x  # NaN -> None (JSON)
