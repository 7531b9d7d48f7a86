"""Helpers for tests and benchmarks that drive the real services from outside.

Processes, HTTP and metrics, and reading topics back are the harness's
(ops/harness/supervisor.py, observe.py, census.py), shared with the demo.
What only tests need is here, one module per concern:

    configs.py     small configs for the tiny model, the admin token, task data
    audit.py       the consumer's audit log (trained.jsonl) and checkpoints, read from outside
    synthetic.py   valid synthetic rollout groups of the tiny model
    feeder.py      SyntheticFeeder (a publishing thread that remembers what it published),
                   PolicyVersion (the newest announced version, as producers see it),
                   flush_half_batch
    topics.py      raw writes and the policy announcements (every one, the newest)
    scripted.py    scripted stand-ins for the rollout engine (episodes, agents), no vLLM
    fakes.py       small stand-ins several files share: a clock the test moves, a pickle bomb
    program.py     Program: a test's own program (an agent, a client, a stand-in trainer)
                   run as a harness Service (process group, log, waits that notice it died)

No helper reads a service's log: addresses and final counters come from its
run file, progress from /metrics or the audit log.
"""
