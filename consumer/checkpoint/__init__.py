"""Checkpoints: exactly-once training state on disk.

    files.py     CheckpointManager: the directory layout, atomic commits, shards, the audit
                 lines a resume reads, keep-K
    cadence.py   Cadence: when a checkpoint is due (every_steps / every_seconds)
    writer.py    a rank's share: which files it writes (checkpoint_shard), the host copy,
                 the one background write in flight (snapshot_shard)

The consumer's service asks `Cadence` after each step and has the leader take one
(consumer/ranks/protocol.py `Leader.checkpoint`); what a checkpoint commits with the model
(ledger, reader offsets) is consumer/stream/ledger.py's.
"""
