"""A cluster on one machine: the twin tests and benchmarks rehearse a deployment on.

    twin.py   hosts as Linux network namespaces on one bridge, each NIC shaped with
              `tc`, a hosts file per host (service names resolve as in the cluster),
              and processes started inside a host with that host's name.

`rlstream twin up|down|ls` (common/cluster/cli.py) drives it by hand; docs/operations.md,
"Rehearse a deployment on the cluster twin", says how.
"""
