"""Prometheus metrics: one registry per process, declared through these helpers.

Every rlstream metric is named `rlstream_*`, counters end in `_total`, times in
`_seconds`, sizes in `_bytes` (docs/metrics.md lists them all). The helpers are
idempotent: declaring the same metric twice returns the existing one, so
modules can declare what they use at import or construction time.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: they double the exposition for nothing

REGISTRY = CollectorRegistry(auto_describe=True)
_LOCK = threading.Lock()
_METRICS: dict[str, object] = {}

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


def _get(kind, name: str, doc: str, labels, **kw):
    if not name.startswith("rlstream_"):
        raise ValueError(f"metric {name!r} must start with rlstream_")
    with _LOCK:
        m = _METRICS.get(name)
        if m is None:
            m = kind(name.removesuffix("_total") if kind is Counter else name, doc,
                     labelnames=tuple(labels), registry=REGISTRY, **kw)
            _METRICS[name] = m
        elif not isinstance(m, kind):
            raise ValueError(f"metric {name!r} already declared as {type(m).__name__}")
        return m


def counter(name: str, doc: str, labels=()) -> Counter:
    """A counter; `name` must end in `_total` (the exposition name)."""
    if not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total")
    return _get(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels=()) -> Gauge:
    return _get(Gauge, name, doc, labels)


def histogram(name: str, doc: str, labels=(), buckets=LATENCY_BUCKETS) -> Histogram:
    return _get(Histogram, name, doc, labels, buckets=buckets)


def exposition() -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(REGISTRY)


def value(name: str, **labels) -> float:
    """Current value of a counter/gauge sample (tests and progress lines)."""
    v = REGISTRY.get_sample_value(name, labels or None)
    return 0.0 if v is None else v
