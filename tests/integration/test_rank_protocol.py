"""The rank protocol on 2 real ranks (torchrun, gloo): consumer/ranks/protocol.py over
consumer/ranks/channel.py, with the real Trainer.

- A follower outlives a wait longer than the default group's timeout (the CPU
  stand-in for NCCL's 10-minute watchdog): it waits on the control channel's
  own gloo group, and the same wait on the default group fails (the control
  experiment, so the stand-in is shown to bite).
- Each rank receives only its own share, as tensors: under dp2 about half the
  batch, under tp2 the whole (both TP ranks train on data-parallel share 0);
  the step through the channel gives the weights and metrics of one process
  on the whole batch.
- The checkpoint of that step (snapshot, background writes on both ranks,
  commit by rank 0) has every shard, and no rank's snapshot holds more host
  memory than its own shards (N7b).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
HERE = Path(__file__).parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import rank_protocol_worker as worker  # noqa: E402
from multirank_worker import make_samples, trainer_config  # noqa: E402


@pytest.fixture(scope="module")
def run(sharp_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rank-protocol")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(HERE / "rank_protocol_worker.py"),
                           str(sharp_model_dir), str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def one_process(megatron_world, sharp_model_dir):
    from rlstream.consumer.train.trainer import Trainer

    trainer = Trainer.from_hf(sharp_model_dir, trainer_config("dp2", one_rank=True))
    metrics = trainer.train_step(trainer.build_batch(make_samples(sharp_model_dir), group_size=4))
    return {"state": trainer.export_hf_state_dict(), "metrics": metrics}


def seen(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}-rank{rank}.json").read_text())


@pytest.mark.timeout(600)
def test_the_follower_outlives_a_wait_past_the_default_groups_timeout(run):
    assert worker.IDLE_S > 2 * worker.WATCHDOG_S
    for layout in worker.LAYOUTS:
        assert seen(run, layout, 1)["backend"] == "gloo"
        assert (run / f"{layout}.pt").exists(), f"{layout}: rank 0 never finished the step"
    # the control experiment: the same idle on the default group kills the wait
    assert seen(run, "default", 1)["outcome"].startswith("failed"), seen(run, "default", 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_each_rank_receives_its_share_and_trains_what_one_process_trains(run, one_process, sharp_model_dir,
                                                                         layout):
    from rlstream.consumer.train.batch import split_global_batch
    from rlstream.consumer.ranks.shares import pack

    s = seen(run, layout, 1)
    # on the wire: rank 1's share as four tensors after their 4 sizes (int64), nothing else
    dp = 2 if layout == "dp2" else 1
    cfg = trainer_config(layout)
    mine = split_global_batch(make_samples(sharp_model_dir), 4, cfg.num_minibatches, "mean", dp)[dp - 1]
    assert s["share_wire_bytes"] == pack(mine).nbytes + 4 * 8
    if layout == "dp2":
        assert s["own_share_bytes"] < 0.6 * s["batch_bytes"]
    else:  # both TP ranks train on the one data-parallel share
        assert s["own_share_bytes"] == s["batch_bytes"]
    got = torch.load(run / f"{layout}.pt", weights_only=False)
    for k, v in one_process["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=0, atol=1e-6)
    for key in ("loss", "kl_train_inference", "grad_norm", "is_weight_mean", "entropy"):
        assert got["metrics"][key] == pytest.approx(one_process["metrics"][key], rel=1e-4), key


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,shards", [("dp2", ["trainer.pt"]),
                                           ("tp2", ["trainer-tp0-ep0.pt", "trainer-tp1-ep0.pt"])])
def test_the_step_was_checkpointed_with_every_shard(run, layout, shards):
    from rlstream.consumer.checkpoint.files import CheckpointManager

    st, path = CheckpointManager(run / f"ckpt-{layout}").latest()
    assert (st.step, st.runs) == (1, [["w", 0]])
    assert sorted(p.name for p in path.glob("trainer*")) == shards
    assert sorted(p.name for p in path.glob("optim-*")) == [f"optim-rank0000{r}-of00002.pt" for r in (0, 1)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_a_rank_holds_only_its_own_shards_at_a_checkpoint(run, layout):
    """N7b: the host bytes of a rank's checkpoint snapshot are at most its own optimizer shard
    (masters and moments) plus its pair's model shard if it writes it, plus a few kB (step
    counters, bucket sizes). Under dp2 the gather to data-parallel rank 0 made rank 0 hold
    both ranks' optimizer state (at 30B-A3B: every expert shard's, on node 0)."""
    for rank in (0, 1):
        s = seen(run, layout, rank)
        assert 0 < s["held_bytes"] <= s["own_bytes"] + 64 * 1024, (rank, s)
