"""Stability: the signals that predict a collapse, and the staleness bound that follows them.

- `signals.py`    per-step signals of the trainer (effective sample size of the token
                  IS weights, sampler-vs-trainer KL, masked/clipped share), overall and
                  split by a record's staleness; collected on the device during the step
- `controller.py` `StalenessController`: `max_staleness: auto` as pure logic (window,
                  thresholds with hysteresis, cooldown, limits); no I/O
- `auto.py`       `AutoStaleness`: the consumer's driver of the controller: feeds it each
                  step's signals, publishes its changes on the control topic with their
                  reason, yields to an operator's setting; its metrics
"""
