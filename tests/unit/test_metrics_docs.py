"""docs/metrics.md lists every metric the code declares, and the names follow Prometheus rules.

The modules that declare metrics do so at import (none of them imports vLLM,
Megatron or torch at module level), so importing them fills
`rlstream.common.metrics._METRICS` with everything a producer or a consumer can expose.
The exposition is then scraped over HTTP from the real `rlstream.common.control.http`
endpoint and parsed with prometheus-client's own text parser.
"""
from __future__ import annotations

import importlib
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from tests.support.house import Layout, source_files
from tests.support.metrics_docs import parse_metric_table

ROOT = Path(__file__).resolve().parents[2]
SOURCES = source_files(ROOT, Layout.read(ROOT))
"""{module: path} of every source file (tests/support/house.py)."""
DOC = ROOT / "docs" / "metrics.md"

# module -> service whose /metrics exposes what it declares
DECLARING_MODULES = {
    "rlstream.common.kafka.publisher": "producer",
    "rlstream.common.kafka.reader": "consumer",
    "rlstream.common.kafka.fetch_wait": "both",
    "rlstream.common.control.plane": "both",
    "rlstream.common.control.http": "both",
    "rlstream.common.control.liveness": "both",
    "rlstream.common.http_server": "both",
    "rlstream.producer.telemetry": "producer",
    "rlstream.producer.prompts": "producer",
    "rlstream.common.tasks.mathjudge": "producer",
    "rlstream.consumer.telemetry": "consumer",
    "rlstream.consumer.stream.intake": "consumer",
}
KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
NON_BASE_UNITS = ("_ms", "_milliseconds", "_microseconds", "_us", "_ns", "_minutes", "_hours",
                  "_kb", "_mb", "_gb", "_kib", "_mib", "_gib", "_percent")


@pytest.fixture(scope="module")
def registry():
    for mod in DECLARING_MODULES:
        importlib.import_module(mod)
    from rlstream.common import metrics

    return metrics


@pytest.fixture(scope="module")
def documented():
    rows = parse_metric_table(DOC.read_text())
    assert len(rows) > 10, "docs/metrics.md table not found or not parsed"
    return rows


def declared_in_source() -> dict[str, str]:
    """name -> service, from the literal names passed to metrics.counter/gauge/histogram."""
    pat = re.compile(r"metrics\.(?:counter|gauge|histogram)\(\s*\"(rlstream_\w+)\"")
    out = {}
    for mod, service in DECLARING_MODULES.items():
        src = SOURCES[mod].read_text()
        for name in pat.findall(src):
            out[name] = service
    return out


def test_parser_reads_a_row():
    rows = parse_metric_table("## Table\n| metric | type | labels | service | meaning |\n|---|---|---|---|---|\n"
                              "| `rlstream_x_total` | counter | `reason` = `a`, `b` | producer | x |\n"
                              "| `rlstream_y` | gauge | | consumer | y |\n")
    assert rows["rlstream_x_total"]["labels"] == ["reason"] and rows["rlstream_y"]["labels"] == []


def test_every_module_that_declares_metrics_is_imported_here():
    pat = re.compile(r"metrics\.(?:counter|gauge|histogram)\(")
    declaring = {mod for mod, p in SOURCES.items() if pat.search(p.read_text())}
    assert declaring <= set(DECLARING_MODULES), f"add to DECLARING_MODULES: {declaring - set(DECLARING_MODULES)}"


def test_every_declared_metric_is_documented_and_vice_versa(registry, documented):
    declared = set(registry._METRICS)
    assert declared == set(declared_in_source()), "a module declares metrics this test does not import"
    missing = sorted(declared - set(documented))
    extra = sorted(set(documented) - declared)
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
    assert not extra, f"docs/metrics.md documents metrics the code does not declare: {extra}"


def test_documented_type_labels_and_service_match_the_code(registry, documented):
    services = declared_in_source()
    for name, m in registry._METRICS.items():
        row = documented[name]
        assert row["type"] in KINDS, f"{name}: unknown type {row['type']!r}"
        assert isinstance(m, KINDS[row["type"]]), f"{name}: documented {row['type']}, declared {type(m).__name__}"
        assert row["labels"] == sorted(m._labelnames), f"{name}: labels {row['labels']} != {sorted(m._labelnames)}"
        assert row["service"] == services[name], f"{name}: service {row['service']!r} != {services[name]!r}"
        assert row["meaning"], f"{name}: no meaning"


def test_names_follow_prometheus_rules(registry):
    from rlstream.common.metrics import LATENCY_BUCKETS

    for name, m in registry._METRICS.items():
        assert re.fullmatch(r"rlstream_[a-z0-9_]+", name), name
        assert not name.endswith(NON_BASE_UNITS), f"{name}: use base units (seconds, bytes)"
        if isinstance(m, Counter):
            assert name.endswith("_total"), f"counter {name} must end in _total"
        else:
            assert not name.endswith("_total"), f"{type(m).__name__} {name} must not end in _total"
        if isinstance(m, Histogram) and tuple(m._upper_bounds[:-1]) == tuple(float(b) for b in LATENCY_BUCKETS):
            assert name.endswith("_seconds"), f"histogram {name} uses latency buckets: name it *_seconds"
        if name.endswith("_seconds") and not name.endswith("_per_second"):
            assert not isinstance(m, Counter) or name.endswith("_seconds_total"), name


def test_scraped_exposition_has_every_documented_family(registry, documented):
    from rlstream.common.control.http import ServiceHttp

    http = ServiceHttp("127.0.0.1", 0, lambda: (True, {})).start()
    try:
        with urllib.request.urlopen(http.url + "/metrics", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
    finally:
        http.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, row in documented.items():
        family = name.removesuffix("_total") if row["type"] == "counter" else name
        assert family in families, f"{name} documented but not in /metrics"
        assert families[family].type == row["type"], f"{name}: exposed as {families[family].type}"
    assert not [n for n in families if n.endswith("_created")], "*_created series are disabled"
