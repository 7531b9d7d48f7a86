"""Worker for test_weight_transfer_multirank.py: export a sharded model over a weight link.

    torchrun --standalone --nproc_per_node N weights_multirank_worker.py MODEL_DIR OUT_DIR LAYOUT

Every rank builds the trainer in LAYOUT (consumer.parallel) from MODEL_DIR and iterates its
weight source (consumer/train/export.py: each layer group gathered to rank 0 within the
TP/EP groups holding it); rank 0 packs it into a snapshot that one gloo link streams, while
it fills, to a receiver thread (common/weights/link.py receive_version, the producer's
receive path). Rank 0 writes what arrived and the version digest to OUT_DIR/LAYOUT.pt.

A layout ending in `_step` first trains one step of multirank_worker.py (its samples and
settings: AdamW under Megatron's distributed optimizer, masters and moments sharded over the
data-parallel ranks), so the export must carry the updated model parameters every rank holds
after the step's parameter all-gather, not the optimizer's shards; rank 0 also writes the
`export_hf_state_dict` of the same weights (test_multirank.py's reference path).
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

LAYOUTS = {"dp2_ep2": (2, {"expert": 2}), "tp2": (2, {"tensor": 2}), "tp2_dp2_ep2": (4, {"tensor": 2, "expert": 2}),
           "dp2_ep2_step": (2, {"expert": 2})}


def trained(model_dir: str, layout: str):
    """The trainer after one step of multirank_worker.py's run (distributed optimizer)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import multirank_worker as mw
    from rlstream.consumer.train.trainer import Trainer

    trainer = Trainer.from_hf(model_dir, mw.trainer_config(layout.removesuffix("_step")))
    assert trainer.optimizer_state_sharded, "the step must run under the sharded optimizer"
    trainer.train_step(trainer.build_batch(mw.make_samples(model_dir), group_size=4))
    return trainer


def main(model_dir: str, out_dir: str, layout: str) -> None:
    import torch.distributed as dist

    from rlstream.common.config import ConsumerSettings
    from rlstream.common.weights import link
    from rlstream.consumer.train.trainer import Trainer
    from rlstream.consumer.weights.snapshot import Snapshot

    torch.set_num_threads(1)
    if layout.endswith("_step"):
        trainer = trained(model_dir, layout)
    else:
        trainer = Trainer.from_hf(model_dir, ConsumerSettings(parallel=LAYOUTS[layout][1]))
    exported = trainer.export_hf_state_dict() if layout.endswith("_step") else {}
    source = trainer.weight_source()
    if dist.get_rank() != 0:
        for _ in source.iter_groups():  # the gathers, in step with rank 0
            pass
    else:
        snap = Snapshot(1, source)
        store = link.open_store("127.0.0.1", 0, 60, master=True)
        n = link.register(link.open_store("127.0.0.1", store.port, 60), "receiver")
        got = {}

        def receive():
            pair = link.GlooPair.open(link.open_store("127.0.0.1", store.port, 60), n, 1, 60)
            got["v"] = link.receive_version(pair)
        t = threading.Thread(target=receive)
        t.start()
        pair = link.GlooPair.open(store, n, 0, 60)
        sender = threading.Thread(target=lambda: link.send_version(pair, snap.header, snap.groups()))
        sender.start()
        digest = snap.fill()  # the collective iteration; the link streams each group as it lands
        sender.join(120)
        t.join(120)
        v = got["v"]
        tensors = {k: t.clone() for k, t in v.tensors()}
        torch.save({"tensors": tensors, "digest": v.digest, "sent": digest,
                    "groups": [g.names for g in v.header.groups],
                    "exported": exported}, Path(out_dir) / f"{layout}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
