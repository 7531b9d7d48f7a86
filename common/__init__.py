"""rlstream.common: what producers and consumers share.

The record schema, Kafka clients, configuration models, metrics helpers, the
weight-store format and the tiny model builder. `producer` and `consumer` never
import each other; both import from here.
"""
