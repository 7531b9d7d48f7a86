"""ops/harness/observe.py: reading a Prometheus exposition."""
from __future__ import annotations

from rlstream.harness.observe import metric, metric_value, parse

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


def test_a_label_called_name_is_a_label():
    m = parse('# TYPE rlstream_trainer_step_metric gauge\nrlstream_trainer_step_metric{name="kl"} 0.5\n')
    assert metric(m, "rlstream_trainer_step_metric", float("nan"), name="kl") == 0.5
    assert metric_value('rlstream_trainer_step_metric{name="kl"} 0.5\n', "rlstream_trainer_step_metric", name="kl") == 0.5


def test_observer_rows_are_interval_rates_and_last_step_values():
    from rlstream.harness.observe import Observer

    def scrapes(samples, reward, trained, kl):
        prod = {("rlstream_producer_samples_total", ()): samples, ("rlstream_producer_reward_sum", ()): reward}
        cons = {("rlstream_consumer_records_total", (("outcome", "trained"),)): trained,
                ("rlstream_consumer_policy_version", ()): trained / 8,
                ("rlstream_trainer_step_metric", (("name", "kl_train_inference"),)): kl}
        return {"producer-0": prod, "consumer": cons}

    obs = Observer(t0=0.0)
    first = obs.row(scrapes(100, 25, 64, 0.5))
    assert first["reward_mean"] == 0.25 and first["generated"] == 100 and first["kl"] == 0.5
    second = obs.row(scrapes(150, 45, 80, 0.25))
    assert second["reward_mean"] == 0.4 and second["generated"] == 50 and second["version"] == 10
    assert second["outcomes"]["trained"] == 80 and second["entropy"] is None  # absent -> None, not NaN


def test_observer_rows_carry_the_stability_signals_by_staleness():
    from rlstream.harness.observe import Observer

    nan = float("nan")
    sig = lambda s, b, v: (("rlstream_trainer_signal", (("signal", s), ("staleness", b))), v)  # noqa: E731
    cons = dict([sig("ess", "all", 0.8), sig("ess", "0", 0.95), sig("token_share", "0", 0.7), sig("kl", "0", 1e-3),
                 sig("ess", "3", 0.4), sig("token_share", "3", 0.3), sig("ess", "5", nan), sig("token_share", "5", nan),
                 (("rlstream_trainer_step_metric", (("name", "ess"),)), 0.8),
                 (("rlstream_control_setting", (("key", "max_staleness"),)), 4.0)])
    row = Observer(t0=0.0).row({"consumer": cons})
    assert row["ess"] == 0.8 and row["max_staleness"] == 4.0 and row["mismatch_kl"] is None
    assert row["by_staleness"] == {"0": {"ess": 0.95, "token_share": 0.7, "kl": 1e-3},
                                   "3": {"ess": 0.4, "token_share": 0.3}}  # a bucket without tokens is left out
