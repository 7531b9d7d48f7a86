"""The trainer's half of the weight path: every version from Megatron to the producers.

- `export.py`    MegatronSource: the HF tensors of one layer group, gathered inside the
                 TP/EP groups that hold them (rank 0 receives).
- `snapshot.py`  Snapshot: one packed, digested version in host memory.
- `engines.py`   the trainer side of vLLM's weight-transfer engines (`rlstream_gloo`,
                 `nccl`): LinkClient, SnapshotSource.
- `sender.py`    WeightSender: the endpoint producers register at, one link each.
- `durable.py`   DurableWriter: the HF copy in the weight store, in the background.
- `announce.py`  Announcer: WeightsReady on rlstream.policy, the transport chosen once.

The wire format, digests and rendezvous are common/weights/; the producer's half is
producer/weights/.
"""
