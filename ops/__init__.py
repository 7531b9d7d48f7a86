"""rlstream: asynchronous streaming RL for Mixture-of-Experts LLMs.

One installed namespace on four floors (tests/unit/test_layers.py holds them):

    rlstream.common            common/     what both services run: config, records, Kafka,
                                           control plane, weight wire, metrics
    rlstream.common.tasks      common/tasks/  tasks, environments and verifiers
    rlstream.producer          producer/   the vLLM rollout service
    rlstream.consumer          consumer/   the Megatron trainer service
    rlstream (this package)    ops/        the tooling on top: the `rlstream` command (cli),
                                           doctor, harness (demo, experiments, evaluation),
                                           cluster twin, toy model

Each floor imports only the floors below it; the two roles never import each other.
"""
