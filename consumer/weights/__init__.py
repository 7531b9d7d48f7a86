"""The trainer's half of the weight path: every version from Megatron to the producers.

- `export.py`    MegatronSource: the HF tensors of one layer group, gathered inside the
                 TP/EP groups that hold them (rank 0 receives).
- `snapshot.py`  Snapshot: one packed, digested version in host memory.
- `backend.py`   the sender's backend, chosen once by name: how a link or the fan-out
                 group opens and sends (`open`, `send`).
- `gloo.py`      `rlstream_gloo`'s trainer engine (ours: a gloo pair or chain, blake3 per group).
- `nccl.py`      vLLM's `nccl` trainer engine fed a snapshot (SnapshotSource), one send at a
                 time under a watchdog.
- `client.py`    LinkClient: vLLM's weight-sync client over a link's command channel.
- `sender.py`    WeightSender: the endpoint producers register at, one link each.
- `fanout.py`    the fan-out group: every later version sent once to all producers.
- `durable.py`   DurableWriter: the HF copy in the weight store, in the background.
- `announce.py`  Announcer: WeightsReady on rlstream.policy, the transport chosen once.

The wire format, digests and rendezvous are common/weights/; the producer's half is
producer/weights/.
"""
