"""The systemd units, as shipped, on a cluster twin: a trainer on two hosts, a producer on a third.

The units of ops/systemd/ are read as systemd reads them (ops/cluster/shipped.py:
ExecStart, Environment=, EnvironmentFile=, ${VAR} expansion) and run on their own
hosts (ops/harness/rehearsal/systemd.py, SystemdOnTwin): `rlstream-consumer.service` on
trainer-0 and trainer-1 (one torchrun job across two hosts, gloo, rendezvous at
trainer-0 as torchrun.env says), `rlstream-producer.service` on producer-0 and the
broker unit on `broker`. The operator's files, which are not shipped, are written
as the install notes say; the swaps (paths, CPU, the tiny-model batch) are listed
in SystemdOnTwin's docstring.

It trains VERSIONS versions; the producer on its own host must take every version
over the collective path. Before the units listened on all interfaces it failed:
rank 0 served HTTP and the weight endpoint on trainer-0's loopback, the trainer
stopped at version 3 (max_staleness 2) and no version reached the producer.
"""
from __future__ import annotations

import pytest

from rlstream.cluster.twin import unavailable_reason
from rlstream.harness.rehearsal.systemd import SystemdOnTwin
from rlstream.harness.supervisor import wait_until

VERSIONS = 5
_WHY = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.broker,
              pytest.mark.skipif(_WHY is not None, reason=f"no cluster twin here: {_WHY}")]


@pytest.mark.timeout(900)
def test_systemd_units_train_across_hosts(tmp_path):
    with SystemdOnTwin(tmp_path, trainers=2, producers=1) as run:
        wait_until(lambda: run.version() >= VERSIONS, 600, f"{VERSIONS} versions trained by the two-host trainer",
                   run.services, interval_s=2)
        want = run.version()
        prod = run.producers[0]
        wait_until(lambda: run.versions_taken(prod) >= want, 120, f"producer-0 to take version {want:.0f}",
                   run.services)
        collective, durable = run.versions_taken(prod, "collective"), run.versions_taken(prod, "file")
        assert collective >= want and durable == 0, (
            f"producer-0 took {collective:.0f} versions over the collective path and {durable:.0f} from the "
            f"durable copy, of {want:.0f}\n{prod.log_tail(3000)}")
        assert run.ranks[1].alive, f"rank 1 on trainer-1 exited:\n{run.ranks[1].log_tail(2000)}"
