"""Worker for test_rank_protocol.py: the real Leader and Follower on 2 ranks (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 rank_protocol_worker.py MODEL_DIR OUT_DIR

The default process group gets a WATCHDOG_S timeout: the CPU stand-in for
NCCL's watchdog, which aborts a rank waiting in a collective longer than its
timeout (10 minutes on GPU). Per layout (dp2, tp2): rank 0 idles IDLE_S >
WATCHDOG_S (a wait on Kafka) before the first command, then trains one step
through the control channel (each rank receives only its share), checkpoints
it (snapshot, background write on both ranks, commit) and stops the
follower. Each rank counts the host bytes its checkpoint snapshot holds
(`held_bytes`, against `own_bytes`: what it owns). Then, as the control
experiment, a broadcast on the default group after the same idle. OUT_DIR/<layout>.json (rank 0: exported weights and
metrics in <layout>.pt) records what each rank saw.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from multirank_worker import make_samples, trainer_config  # noqa: E402

WATCHDOG_S, IDLE_S = 3, 8
LAYOUTS = ("dp2", "tp2")


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def count_snapshot_bytes(held: list[int]) -> None:
    """Every host copy consumer/checkpoint/writer.py takes for a checkpoint adds its bytes to `held`."""
    from rlstream.consumer.checkpoint import writer

    copy = writer.host_copy

    def counted(obj):
        out = copy(obj)
        held.append(tensor_bytes(out))
        return out
    writer.host_copy = counted


def own_bytes(trainer) -> int:
    """What this rank owns: its shard of the fp32 masters and two Adam moments, and the
    model shard of its (tp, ep) pair if it is the pair's writer (expert-data-parallel rank 0)."""
    from megatron.core import parallel_state as ps

    from rlstream.consumer.train.layout import local_megatron_state_dict

    optimizer = 3 * 4 * sum(m.numel() for m in trainer.optimizer.fp32_masters().values())
    writer = ps.get_expert_data_parallel_rank() == 0
    return optimizer + (tensor_bytes(local_megatron_state_dict(trainer.model)) if writer else 0)


def one_layout(model_dir: str, out: Path, layout: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlstream.consumer.ranks.channel import RankChannel
    from rlstream.consumer.checkpoint.files import CheckpointManager, CheckpointState
    from rlstream.consumer.ranks.protocol import Follower, Leader
    from rlstream.consumer.ranks.shares import sample_bytes
    from rlstream.consumer.train.trainer import Trainer
    from rlstream.consumer.train.export import collect

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    trainer = Trainer.from_hf(model_dir, trainer_config(layout))
    ckpt = CheckpointManager(out / f"ckpt-{layout}")
    channel = RankChannel(ps.get_data_parallel_rank())
    rank = dist.get_rank()
    seen = {"backend": dist.get_backend(channel.group), "rank": rank, "own_bytes": own_bytes(trainer)}
    held: list[int] = []
    count_snapshot_bytes(held)
    samples = make_samples(model_dir)
    if rank == 0:
        time.sleep(IDLE_S)  # rank 0 waits on Kafka; the follower waits in the channel
        leader = Leader(trainer, ckpt, group_size=4, channel=channel)
        metrics = leader.train(samples)
        leader.checkpoint(CheckpointState(1, 1, {0: 16}, runs=[["w", 0]]))
        state = collect(leader.export())  # the followers iterate the weight source in step
        leader.stop()
        torch.save({"state": state, "metrics": metrics}, out / f"{layout}.pt")
    else:
        Follower(trainer, ckpt, channel).run()
        mine = trainer.split_batch(samples, 4)[ps.get_data_parallel_rank()]  # the share it should get
        whole = sum(sample_bytes(s) for s in trainer.split_batch(samples, 4))
        seen.update(share_wire_bytes=channel.last_share_bytes, own_share_bytes=sample_bytes(mine),
                    batch_bytes=whole, received_bytes=channel.received_bytes)
    seen["held_bytes"] = sum(held)
    (out / f"{layout}-rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier(group=channel.group)


def default_group_after_idle(out: Path) -> None:
    """The control experiment: the same idle, then a broadcast on the default group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.zeros(1)
    if rank == 0:
        time.sleep(IDLE_S)
    try:
        dist.broadcast(t, src=0)
        outcome = "ok"
    except RuntimeError as e:
        outcome = f"failed: {str(e)[:200]}"
    (out / f"default-rank{rank}.json").write_text(json.dumps({"outcome": outcome}))


def main(model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=WATCHDOG_S))
    out = Path(out_dir)
    for layout in LAYOUTS:
        one_layout(model_dir, out, layout)
    default_group_after_idle(out)
    os._exit(0)  # the default group may be broken by the control experiment: no teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
