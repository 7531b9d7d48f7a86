"""common/weights/watchdog.py: a blocked transfer without progress is aborted within its bound;
one that keeps beating is not."""
from __future__ import annotations

import threading
import time

import pytest

from rlstream.common.errors import WeightTransferError
from rlstream.common.weights.watchdog import Watchdog


def test_a_call_blocked_without_progress_is_aborted_within_the_bound():
    unblocked = threading.Event()  # the transport's blocking call, which the abort makes fail
    t0 = time.monotonic()
    with pytest.raises(WeightTransferError, match="no progress for 0 s"):
        with Watchdog(0.3, abort=unblocked.set, what="nccl update"):
            assert unblocked.wait(10), "never aborted"
            raise RuntimeError("NCCL error: remote process exited or there was a network error")
    assert time.monotonic() - t0 < 0.3 + 2.0  # the bound, plus a margin for a loaded machine


def test_a_transfer_that_keeps_progressing_is_not_aborted():
    aborted = []
    with Watchdog(1.0, abort=lambda: aborted.append(1)) as dog:
        for _ in range(15):  # 1.5 s in all, never 1 s without a beat (a margin for a loaded machine)
            time.sleep(0.1)
            dog.beat()
    assert not aborted and not dog.fired
