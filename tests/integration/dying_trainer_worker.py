"""A trainer that hangs mid-version, for test_weight_transfer's SIGKILL test (run with -m).

    python -m tests.integration.dying_trainer_worker MODEL_DIR STORE_DIR TIMEOUT_S

Publishes version 1 (the model's weights perturbed) over the real WeightSender and prints its
announcement (one JSON line); every link then gets the header and the first group, and the
sender blocks there until the test kills this process."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from rlstream.common.weights import link
from tests.support.weights import TrainerSide, perturbed, read_weights

_SENDS_BEFORE_HANGING = 4  # header length, header, group 0, its digest


def main(model_dir: str, store_dir: str, timeout_s: float) -> None:
    sends, send = {"n": 0}, link.GlooPair.send

    def send_then_hang(self, t):
        sends["n"] += 1
        if sends["n"] > _SENDS_BEFORE_HANGING:
            print("hanging", flush=True)
            threading.Event().wait()  # mid-version, until SIGKILL
        send(self, t)

    link.GlooPair.send = send_then_hang
    trainer = TrainerSide(Path(store_dir), model_dir, timeout_s=timeout_s)
    msg = trainer.publish(1, perturbed(read_weights(model_dir), seed=1))
    print(msg.model_dump_json(), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
