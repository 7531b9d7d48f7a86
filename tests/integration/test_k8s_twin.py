"""The k8s manifests, as shipped, on a cluster twin: the trainer JobSet on two hosts, producers on others.

ops/k8s/ is read as the cluster would run it (ops/cluster/shipped.py): the
ConfigMap's rlstream.yaml, the consumer JobSet's torchrun command (`$(NODE_RANK)`
from the completion index) and the producer Deployment's args and env. Every
pod is a host of its own (ops/harness/rehearsal/k8s.py, K8sOnTwin) whose hosts
file resolves the names cluster DNS would: the Kafka bootstrap Service, each
Service of services.yaml and each JobSet pod on its subdomain, which is what
the ConfigMap announces to producers (consumer.weights.advertise_host) and
torchrun rendezvous at.

What the rehearsal swaps, and nothing else, is K8S_CONFIG_SWAPS (model, device,
cluster size in the config), CONSUMER_SWAPS / PRODUCER_SWAPS (the environment
overrides compose uses) and K8S_SWAPS (image, volumes, Kafka, GPUs per node,
replicas, the Secret); the assertion message repeats them.

It trains VERSIONS versions and checks that every producer, each on a host other
than the trainer's, took every version over the collective path and none from
the durable copy. On the manifests of a0ae2f8 (no consumer.weights: the endpoint
listened on and announced 127.0.0.1, the review's N3) it fails: no version
crosses a host.
"""
from __future__ import annotations

import pytest

from rlstream.harness.rehearsal.k8s import K8S_CONFIG_SWAPS, K8S_SWAPS, K8sOnTwin
from tests.support.twin import TWIN_MARKS, every_version_crosses_hosts

VERSIONS = 5
pytestmark = TWIN_MARKS


@pytest.mark.timeout(900)
def test_k8s_manifests_train_across_hosts_over_the_collective_path(tmp_path, tiny_model_dir):
    with K8sOnTwin(tmp_path, producers=1, model_from=tiny_model_dir) as run:
        assert len(run.ranks) == 2, "the JobSet runs the trainer on two nodes"
        every_version_crosses_hosts(run, VERSIONS, swaps=f"{K8S_CONFIG_SWAPS} {K8S_SWAPS}")
        assert run.ranks[1].alive, f"rank 1 exited:\n{run.ranks[1].log_tail(2000)}"
