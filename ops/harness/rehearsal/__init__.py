"""The shipped deployments, started on a cluster twin: each service on a host of its own.

    compose.py   ComposeOnTwin: ops/compose/docker-compose.yml: kafka, consumer, producer-i hosts
    systemd.py   SystemdOnTwin: ops/systemd/ units: broker, trainer-0..N-1 (one torchrun job
                 across hosts), producer-i hosts
    k8s.py       K8sOnTwin: ops/k8s/ manifests: the Kafka Service's host, the consumer JobSet's
                 pods (one torchrun job across them), the producer Deployment's pods
    base.py      what the three share: the swaps of every deployment, a shipped service as a
                 supervised process on its host (ShippedOnTwin), the Rehearsal base class

Shared by tests/integration/test_deployment_twin.py, test_systemd_twin.py and
test_k8s_twin.py (do they train across hosts?) and tests/bench/cluster.py (how
fast, how many bytes).
Commands and environments come from the shipped files through
ops/cluster/shipped.py; the only changes are the swaps (SWAPS, CONSUMER_SWAPS,
PRODUCER_SWAPS in base.py; K8S_CONFIG_SWAPS, K8S_SWAPS in k8s.py), each one a
device or packaging difference between GPU nodes and this CPU machine, never a
setting the deployment gets wrong. More producers than a file ships are made the
way it tells users to: copies with a new name and producer id.
"""
