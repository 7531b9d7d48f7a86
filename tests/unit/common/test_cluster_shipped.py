"""The k8s manifests read as the cluster runs them (ops/cluster/shipped.py), and the
rehearsal's swaps (ops/harness/rehearsal/k8s.py) kept off what decides reachability.
Pure file logic: no twin, no root."""
from __future__ import annotations

import pytest
import yaml

from rlstream.cluster.shipped import (
    cluster_dns,
    dockerfile_entrypoint,
    external_service_names,
    k8s_config_text,
    k8s_deployment,
    k8s_documents,
    k8s_expand,
    k8s_jobset,
    k8s_service,
)
from rlstream.harness.rehearsal.k8s import DOCKERFILE, K8S, K8S_CONFIG_SWAPS, swap_config

SECRETS = {("rlstream-secrets", "admin-token"): "t", ("rlstream-secrets", "kafka-password"): "p"}


@pytest.fixture(scope="module")
def docs():
    return k8s_documents(K8S)


def test_k8s_expand_is_kubernetes_dollar_paren_syntax():
    env = {"NODE_RANK": "1"}
    assert k8s_expand("--node_rank=$(NODE_RANK)", env) == "--node_rank=1"
    assert k8s_expand("$$(NODE_RANK) $(UNSET) ${NODE_RANK}", env) == "$(NODE_RANK) $(UNSET) ${NODE_RANK}"


def test_each_jobset_pod_runs_torchrun_with_its_completion_index(docs):
    trainer = k8s_jobset(docs, "rlstream-consumer")
    assert [p.name for p in trainer.pods] == ["rlstream-consumer-trainer-0-0", "rlstream-consumer-trainer-0-1"]
    for pod in trainer.pods:
        svc = k8s_service(trainer, pod, dockerfile_entrypoint(DOCKERFILE), SECRETS)
        assert svc.command[0] == "torchrun" and f"--node_rank={pod.index}" in svc.command
        assert svc.environment["RLSTREAM_ADMIN_TOKEN"] == "t"


def test_a_deployment_pod_runs_the_image_entrypoint_with_its_args(docs):
    producer = k8s_deployment(docs, "rlstream-producer", replicas=2)
    svc = k8s_service(producer, producer.pods[1], dockerfile_entrypoint(DOCKERFILE), SECRETS)
    assert svc.command[:2] == ["rlstream", "producer"]
    assert svc.environment["RLSTREAM__PRODUCER__PRODUCER_ID"] == "rlstream-producer-1"  # metadata.name


def test_a_missing_secret_is_named(docs):
    producer = k8s_deployment(docs, "rlstream-producer", replicas=1)
    with pytest.raises(KeyError, match="rlstream-secrets key kafka-password"):
        k8s_service(producer, producer.pods[0], ["rlstream"], {("rlstream-secrets", "admin-token"): "t"})


def test_cluster_dns_resolves_what_the_manifests_dial(docs):
    """torchrun's master_addr, the announced weight endpoint and the rank-0 Service name the
    pod that runs rank 0; Kafka's bootstrap is a name of its own host."""
    trainer = k8s_jobset(docs, "rlstream-consumer")
    producer = k8s_deployment(docs, "rlstream-producer", replicas=2)
    names = cluster_dns(docs, trainer.pods + producer.pods, trainer.namespace)
    rank0 = names["rlstream-consumer-trainer-0-0"]
    args = trainer.container["args"]
    master = next(a.split("=", 1)[1] for a in args if a.startswith("--master_addr="))
    cfg = yaml.safe_load(k8s_config_text(docs))
    assert master in rank0 and cfg["consumer"]["weights"]["advertise_host"] in rank0
    assert "rlstream-consumer" in rank0 and "rlstream-consumer.rlstream.svc.cluster.local" in rank0
    assert "rlstream-consumer" not in names["rlstream-consumer-trainer-0-1"]  # the Service selects index 0
    bootstrap = cfg["kafka"]["bootstrap_servers"].rpartition(":")[0]
    assert bootstrap in external_service_names(bootstrap, "rlstream")
    assert "rlstream-kafka-bootstrap" not in external_service_names(bootstrap, "rlstream")  # another namespace


def test_swaps_leave_what_decides_reachability_as_shipped(docs):
    """The swaps are model, device and size: the settings that made N3 (where the weight
    endpoint listens, what it announces, the ports, the transport, staleness) stay."""
    kept = ("consumer.weights.host", "consumer.weights.advertise_host", "consumer.weights.port",
            "consumer.weights.transport", "consumer.http", "producer.http", "staleness", "kafka.bootstrap_servers")
    assert not [k for k in K8S_CONFIG_SWAPS if k.startswith(kept)]
    shipped = yaml.safe_load(k8s_config_text(docs))
    swapped = yaml.safe_load(swap_config(k8s_config_text(docs), K8S_CONFIG_SWAPS, lambda s: s))
    for key in kept:
        a, b = shipped, swapped
        for k in key.split("."):
            a, b = a[k], b[k]
        assert a == b, key
    assert swapped["consumer"]["parallel"]["tensor"] == 1 and swapped["producer"]["engine"]["dtype"] == "float32"
