"""Helpers for tests and benchmarks that drive the real services from outside.

Processes, HTTP and metrics, and reading topics back are the harness's
(ops/harness/supervisor.py, observe.py, census.py), shared with the demo.
What only tests need is here, one module per concern:

    configs.py     small configs for the tiny model, the admin token, task data, trainer settings
    audit.py       the consumer's audit log (trained.jsonl) and checkpoints, read from outside
    state.py       trainer state and parameters as plain tensors, for comparisons
    synthetic.py   valid synthetic rollout groups of the tiny model
    feeder.py      SyntheticFeeder (a publishing thread that remembers what it published),
                   PolicyVersion (the newest announced version, as producers see it),
                   flush_half_batch
    topics.py      raw writes, the policy announcements (every one, the newest), the rollouts
                   as the consumer's reader takes them, a trainer's start announced by hand
    scripted.py    scripted stand-ins for the rollout engine (episodes, agents), no vLLM
    fakes.py       small stand-ins several files share: a clock the test moves, a pickle bomb,
                   a weight link's command channel
    program.py     Program: a test's own program (an agent, a client, a stand-in trainer)
                   run as a harness Service (process group, log, waits that notice it died)

and one module per family of tests that share more than a stand-in:

    engine.py              driving a RolloutEngine by hand
    progress.py            waits that follow progress, not a wall clock sized for a quiet machine
    weights.py             weight versions for the collective-path tests (HF tensors, a WeightSource)
    collectives.py         what the trainer sends through torch.distributed, and where its tensors live
    precision.py           bf16 weight updates against an fp32 reference
    twin.py                what every deployment rehearsal on the cluster twin checks
    calc_agent.py          a small black-box agent (the calculator tool loop over the OpenAI client)
    agent_endpoint.py      the agent endpoint's driver over the scripted engine, and its HTTP server
    journal_memory.py      the producer's journal without a broker (entries, the topic's fold, leases)
    journaled_episodes.py  producers on the session's engine that crash and resume journaled episodes
    ledger_records.py      records fed straight into a consumer Ledger
    fuzz_records.py        bad records (hypothesis strategies) and a live consumer's feed
    http_clients.py        hostile HTTP clients: raw exchanges, tricklers, floods
    hf_reference.py        HF transformers as the independent reference (log-probs, replayed routing)
    router_hooks.py        what the Megatron model's routers dispatched with
    preemption.py          routing under preemption: the worker process and the check
    multirank.py           the trainer's multi-rank worker under torchrun
    benches.py             the benches' registry (keys, timeouts, marks) and one bench run
    bench_pool.py          bench smokes two at a time
    shipped_manifests.py   the k8s and compose files under ops/, read as data
    metrics_docs.py        docs/metrics.md's table, parsed
    house.py               the shape of the code base (python -m tests.support.house)

A test file never imports another test file (tests/unit/test_layers.py): what two files
share is here.

No helper reads a service's log: addresses and final counters come from its
run file, progress from /metrics or the audit log.
"""
