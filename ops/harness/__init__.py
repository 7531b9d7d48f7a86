"""Runs the services as processes and measures them (off the runtime path).

    supervisor.py   a service as a child process: incarnations, run file, stop/kill; a run's processes
    observe.py      HTTP, Prometheus scrapes, progress rows
    census.py       topics read back; record accounting
    runs.py         one RL run from a warm start: start, watch, stop rule, stop, account
    demo.py         `rlstream demo`: warm start -> run -> report
    experiments.py  `rlstream experiment`: side-by-side runs
    rehearsal/      compose, systemd and k8s deployments as shipped, each service on a host of a cluster twin
    sft.py, evaluate.py, report.py   warm start, held-out evaluation, report and plots

The demo, the experiments, the integration tests and the benchmarks all use
these; tests/support/ adds only what tests alone need.
"""
