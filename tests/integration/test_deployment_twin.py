"""The compose deployment, as shipped, on a cluster twin: every service on a host of its own.

ops/compose/docker-compose.yml is read as Docker Compose reads it
(ops/cluster/shipped.py): the same commands, the same environment, the same
service names, which every host resolves through its hosts file as the compose
network's DNS would. Each service runs in a network namespace of its own
(ops/harness/rehearsal/compose.py), so a setting that only works on one host (a
weight endpoint bound to or announced as 127.0.0.1, the review's N3) fails here
as it would on a cluster: on the compose file before the N3 fix the producers
log `weight endpoint 127.0.0.1:<port> unreachable` and stay at version 0.

What the harness swaps, and nothing else, is `rehearsal.base.SWAPS` (tansu for the
Kafka image, CPU for the GPUs, the checkout for the image's paths, eager mode,
a smaller batch without the zero-variance filter for the untrained tiny model);
the assertion message repeats it.

It trains VERSIONS versions and checks that both producers, each on another host
than the trainer, took every version over the collective path
(rlstream_producer_weight_versions_total{transport="collective"}), none from the
durable file copy.
"""
from __future__ import annotations

import pytest

from rlstream.harness.rehearsal.base import SWAPS
from rlstream.harness.rehearsal.compose import ComposeOnTwin
from tests.support.twin import TWIN_MARKS, every_version_crosses_hosts

VERSIONS = 5
pytestmark = TWIN_MARKS


@pytest.mark.timeout(900)
def test_compose_trains_on_a_cluster_twin_over_the_collective_path(tmp_path):
    with ComposeOnTwin(tmp_path, producers=2) as run:
        every_version_crosses_hosts(run, VERSIONS, swaps=str(SWAPS))
