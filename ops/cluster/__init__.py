"""A cluster on one machine: the twin tests and benchmarks rehearse a deployment on.

    twin.py     hosts as Linux network namespaces on one bridge, each NIC shaped with
                `tc`, a hosts file per host (service names resolve as in the cluster),
                and processes started inside a host with that host's name.
    shipped.py  the shipped deployment files (compose, systemd units, k8s manifests)
                read as their orchestrator runs them: commands, environments and,
                for k8s, the names cluster DNS gives Services and pods.
    cli.py      `rlstream twin up|down|exec`.

ops/harness/rehearsal/ starts the compose, systemd and k8s deployments on a twin
(tests, benchmarks).

docs/operations.md, "Rehearse a deployment on the cluster twin", says how.
"""
