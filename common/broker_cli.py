"""`rlstream broker`: run the bundled tansu broker until SIGTERM/SIGINT."""
from __future__ import annotations

from common.config import RlstreamConfig


def main(cfg: RlstreamConfig) -> int:
    from common.broker import run_broker_forever

    return run_broker_forever(cfg.broker, cfg.kafka)
