"""consumer/checkpoint/files.py's files: one per (tp, ep) pair and one per rank (each rank's own
optimizer shard), the commit on all of them, and loading both that form and the older one
(the optimizer state gathered into the pair's file)."""
from __future__ import annotations

import pytest
import torch

from rlstream.common.errors import CheckpointError
from rlstream.consumer.checkpoint.files import (
    CheckpointManager,
    CheckpointState,
    all_shard_names,
    rank_shard_name,
)
from rlstream.consumer.train.optimizer import GATHERED, PER_RANK, join_rank_state, split_rank_state


def trainer_state(rank: int = 0) -> dict:
    """The shape of Trainer.state_dict(): a dense optimizer part with this rank's shard, an
    expert part likewise, and a non-distributed one (sgd) without per-rank state."""
    own = {"per_bucket_numel": [4], 0: {torch.float32: [[{"param": torch.full((2,), float(rank)),
                                                          "exp_avg": torch.zeros(2)}]]}}
    parts = [{"optimizer": {"param_groups": [{"lr": 1e-3}]}, "param_state": own,
              "param_state_sharding_type": PER_RANK},
             {"optimizer": {"param_groups": [{"lr": 1e-3}]}, "param_state": own,
              "param_state_sharding_type": PER_RANK},
             {"state": {}, "param_groups": [{"lr": 1e-3}]}]
    return {"model": {"w": torch.ones(3)}, "optimizer": {"distributed": True, "parts": parts}, "step": 7}


def write_new_form(ckpt: CheckpointManager, world: int, step: int = 1):
    """What consumer/ranks/protocol.py writes: rank 0 the pair's file, every rank its own."""
    tmp = ckpt.begin(step)
    for rank in range(world):
        state = trainer_state(rank)
        state["optimizer"], own = split_rank_state(state["optimizer"])
        if rank == 0:
            ckpt.write_shard(tmp, "trainer.pt", state)
        ckpt.write_shard(tmp, rank_shard_name(rank, world), own)
    return ckpt.commit(tmp, CheckpointState(step, step, {0: 3}), all_shard_names(world=world))


def test_the_pair_file_holds_no_rank_state_and_the_rank_file_only_its_own():
    state = trainer_state(rank=1)
    shared, own = split_rank_state(state["optimizer"])
    assert all("param_state" not in p for p in shared["parts"])
    assert [o is None for o in own] == [False, False, True]  # sgd's part has no per-rank state
    assert own[0][0][torch.float32][0][0]["param"].tolist() == [1.0, 1.0]
    assert join_rank_state(shared, own) == state["optimizer"]  # the same objects back in place
    with pytest.raises(CheckpointError, match="mixed"):
        join_rank_state(shared, own[:2])


def test_every_rank_resumes_its_own_optimizer_shard(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    path = write_new_form(ckpt, world=2)
    assert sorted(p.name for p in path.glob("*.pt")) == ["optim-rank00000-of00002.pt",
                                                         "optim-rank00001-of00002.pt", "trainer.pt"]
    for rank in (0, 1):
        got = ckpt.load_trainer_state(path, "trainer.pt", rank_shard_name(rank, 2))
        part = got["optimizer"]["parts"][1]
        assert part["param_state_sharding_type"] == PER_RANK
        assert part["param_state"][0][torch.float32][0][0]["param"].tolist() == [float(rank)] * 2
        assert torch.equal(got["model"]["w"], torch.ones(3)) and got["step"] == 7


def test_a_missing_rank_file_keeps_the_checkpoint_uncommitted(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    tmp = ckpt.begin(1)
    ckpt.write_shard(tmp, "trainer.pt", {"model": {}})
    ckpt.write_shard(tmp, rank_shard_name(0, 2), [None])
    with pytest.raises(CheckpointError, match="optim-rank00001-of00002.pt"):
        ckpt.commit(tmp, CheckpointState(1, 1, {}), all_shard_names(world=2))
    assert ckpt.latest() is None


def test_a_checkpoint_from_before_the_rank_files_loads_as_it_is(tmp_path):
    """The older form: the optimizer state gathered into trainer.pt, no per-rank file."""
    ckpt = CheckpointManager(tmp_path)
    old = trainer_state()
    for p in old["optimizer"]["parts"][:2]:
        p["param_state_sharding_type"] = GATHERED
    path = ckpt.save(CheckpointState(1, 1, {0: 3}), old)
    got = ckpt.load_trainer_state(path, "trainer.pt", rank_shard_name(0, 1))
    assert got["optimizer"]["parts"][0]["param_state_sharding_type"] == GATHERED
    assert torch.equal(got["optimizer"]["parts"][0]["param_state"][0][torch.float32][0][0]["param"],
                       torch.zeros(2))


def test_rank_files_of_another_world_size_are_refused_with_what_to_do(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    path = write_new_form(ckpt, world=2)
    with pytest.raises(CheckpointError, match=r"optim-rank00000-of00002.pt.*another number of ranks"):
        ckpt.load_trainer_state(path, "trainer.pt", rank_shard_name(0, 4))


def test_a_checkpoint_of_another_experts_kernel_is_refused_naming_the_setting():
    """`consumer.memory.experts: auto` depends on the host (TE, CUDA): a checkpoint written with the
    sequential experts, resumed where auto gives a grouped kernel, must say so (not fail in an
    assertion on Megatron's bucket sizes), before any tensor is touched."""
    from types import SimpleNamespace

    from rlstream.common.errors import CheckpointError
    from rlstream.consumer.train.trainer import Trainer

    trainer = SimpleNamespace(model=SimpleNamespace(experts="torch_grouped"))
    with pytest.raises(CheckpointError, match="consumer.memory.experts.*sequential experts kernel"):
        Trainer.load_state_dict(trainer, {"experts": "sequential", "model": {}, "optimizer": {}, "step": 3})
