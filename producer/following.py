"""What the producer follows: the operator's control settings, the trainer's
progress and the trainer's new weights (the service loop's `follow_control` step).

The control topic (common/control/plane.py `ControlFollower`) carries runtime
settings (`paused`, `max_staleness`, ...), `TrainerProgress` and `WeightsReady`
announcements; only the newest announcement of a poll is applied. Weights come
over the link to the trainer or from the durable store (producer/weights/reload.py).
A weight update runs under the liveness monitor's bound: a transfer that never
ends (a hung trainer, NCCL without a timeout) makes the producer not live.
"""
from __future__ import annotations

import logging

from rlstream.common.config import ControlSettings, RlstreamConfig
from rlstream.common.control.liveness import ProgressMonitor
from rlstream.common.control.messages import TrainerProgress, WeightsReady
from rlstream.common.lifecycle import close_attrs
from rlstream.producer import telemetry

log = logging.getLogger("rlstream.producer")


class Following:
    """`control` and `progress` as last seen; `follow()` once per loop iteration."""

    def __init__(self, follower, group_size: int):
        """`follower`: a ControlFollower (common/control/plane.py) started at the configured settings."""
        self.follower = follower
        self.follower.catch_up()  # every setting and announcement on the topics, before the engine starts
        self.control: ControlSettings = follower.view.state
        # the trainer's last TrainerProgress; until one arrives: version 0, B = 1
        # (the most cautious estimate), nothing read
        self.progress = TrainerProgress(trainer_version=0, groups_per_batch=1, group_size=group_size)
        self.reloader = None

    def start_weights(self, engine, cfg: RlstreamConfig, producer_id: str) -> None:
        """Attach the engine's weight reloader and catch up to the newest announced version
        before generating."""
        from rlstream.producer.weights.reload import Reloader  # defers torch

        self.reloader = Reloader(engine, cfg.model.path, producer_id, cfg.producer.engine.weight_transfer_timeout_s,
                                 store_dir=cfg.consumer.weight_store_dir)
        self.follow(None, 0.0, weights=False)
        if self.follower.view.weights is not None:
            self.reloader.catch_up(self.follower.view.weights)

    def weight_state(self) -> dict:
        """The reloader's weight state for /healthz and /readyz (the HTTP thread starts first)."""
        return self.reloader.state() if self.reloader is not None else {"state": "starting"}

    def follow(self, liveness: ProgressMonitor | None, update_limit_s: float, weights: bool = True) -> None:
        newest = None
        for event in self.follower.poll():
            if isinstance(event, WeightsReady):
                newest = event  # only the newest version of a poll matters
        if weights:
            with liveness.operation("weight_update", update_limit_s):
                if newest is not None:
                    self.reloader.apply(newest)
                self.reloader.tick()  # the link: the trainer's commands, a received version to swap in
        view = self.follower.view  # also what polls before this one saw (start-up)
        if view.progress is not None:
            self.progress = view.progress
            telemetry.TRAINER_VERSION.set(view.progress.trainer_version)
        self.control = view.state

    def close(self) -> None:
        close_attrs(self, ("follower", "reloader"), log)
