"""What every deployment rehearsal on the cluster twin checks (tests/integration/test_*_twin.py).

    pytestmark = TWIN_MARKS                       # slow, real parts, skipped without a twin (says why)
    with K8sOnTwin(tmp_path, ...) as run:
        every_version_crosses_hosts(run, VERSIONS, swaps=f"{K8S_CONFIG_SWAPS} {K8S_SWAPS}")

The property: each producer, on a host other than the trainer's, takes every trained version over
the collective path and none from the durable copy. A setting that works on one host only (a weight
endpoint bound to or announced as 127.0.0.1, the review's N3) fails it: no version crosses a host.
"""
from __future__ import annotations

import pytest

from rlstream.cluster.twin import unavailable_reason
from rlstream.harness.supervisor import wait_until

_WHY = unavailable_reason()
TWIN_MARKS = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.broker,
              pytest.mark.skipif(_WHY is not None, reason=f"no cluster twin here: {_WHY}")]


def every_version_crosses_hosts(run, versions: int, swaps: str) -> None:
    """Train `versions` versions on `run` (a rehearsal.base.Rehearsal); every producer took each one over
    the collective path, none from the durable copy. `swaps`: what the rehearsal swapped (the
    assertion message repeats it)."""
    wait_until(lambda: run.version() >= 1, 600, "the first version", run.services, interval_s=1)
    try:  # fail fast with the reason when no version crosses hosts (N3: it took ~10 min to time out)
        wait_until(lambda: all(run.versions_taken(p, "collective") >= 1 for p in run.producers), 120,
                   "every producer to take version 1 over the collective path", run.services)
    except Exception as e:
        pytest.fail(f"{e}\n--- {run.producers[0].name}:\n{run.producers[0].log_tail(2000)}")
    wait_until(lambda: run.version() >= versions, 600, f"{versions} versions trained", run.services, interval_s=1)
    want = run.version()
    # a producer takes a version within seconds of its announcement
    wait_until(lambda: all(run.versions_taken(p) >= want for p in run.producers), 120,
               f"every producer to take version {want:.0f}", run.services)
    for p in run.producers:
        collective, durable = run.versions_taken(p, "collective"), run.versions_taken(p, "file")
        assert collective >= want and durable == 0, (
            f"{p.name} took {collective:.0f} versions over the collective path and {durable:.0f} from the "
            f"durable copy, of {want:.0f}; swaps: {swaps}\n--- {p.name}:\n{p.log_tail(3000)}"
            f"\n--- trainer (rank 0):\n{run.consumer.log_tail(3000)}")
