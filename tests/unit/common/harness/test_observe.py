"""common/harness/observe.py: reading a Prometheus exposition."""
from __future__ import annotations

from common.harness.observe import metric, metric_value, parse

TEXT = """# TYPE rlstream_consumer_records counter
rlstream_consumer_records_total{outcome="trained"} 640.0
rlstream_consumer_records_total{outcome="dlq"} 2.0
# TYPE rlstream_dlq_records counter
rlstream_dlq_records_total{field="<bytes>",topic="t"} 3.0
rlstream_dlq_records_total{field="logprobs",topic="t"} 1.0
# TYPE rlstream_consumer_lag_records gauge
rlstream_consumer_lag_records 0.0
"""


def test_metric_is_exact_and_metric_value_sums_label_subsets():
    m = parse(TEXT)
    assert metric(m, "rlstream_consumer_records_total", outcome="trained") == 640
    assert metric(m, "rlstream_dlq_records_total", field="logprobs") == 0.0  # labels must match exactly
    assert metric(m, "rlstream_nothing", default=-1.0) == -1.0
    assert metric(None, "rlstream_consumer_lag_records", 7.0) == 7.0
    assert metric_value(TEXT, "rlstream_dlq_records_total") == 4
    assert metric_value(TEXT, "rlstream_dlq_records_total", field="logprobs") == 1
    assert metric_value(TEXT, "rlstream_consumer_records_total") == 642
    assert metric_value(TEXT, "rlstream_consumer_records_total", outcome="nope") == 0
