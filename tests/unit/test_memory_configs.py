"""The configs for the clusters people have (issue 26 item 4): one node of 8 x 80 GB, two
such nodes, two nodes of 8 x H200, each against the memory check of consumer/train/memory_check.py
(GPU and host); the optimizer CPU offload's arithmetic against a hand calculation; and the
offload setting reaching megatron-core 0.16.1 (its HybridDeviceOptimizer needs CUDA, so no
step runs here: the factory call is stopped where it builds the offloading optimizer).
These are estimates; no GPU ran any of these files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlstream.common.config import OptimizerSettings, load_config
from rlstream.common.errors import ConfigError
from rlstream.consumer.train.memory_budget import (
    GB,
    MemoryPlan,
    estimate,
    host_estimate,
    parameter_counts,
)
from rlstream.consumer.train.memory_check import check_config
from rlstream.consumer.train.model import HFModelDims

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B = ROOT / "tests" / "fixtures" / "models" / "qwen3-30b-a3b"
ONE_NODE = ROOT / "configs" / "qwen3-30b-a3b-onpolicy-bf16-1x8-80gb.yaml"
TWO_NODES = ROOT / "configs" / "qwen3-30b-a3b-onpolicy-bf16-2x8-80gb.yaml"
TWO_NODES_H200 = ROOT / "configs" / "qwen3-30b-a3b-onpolicy-bf16-2x8-h200.yaml"
DOCS = ROOT / "docs" / "operations.md"


def check(path: Path, *overrides: str):
    return check_config(load_config(path, [f"model.path={QWEN3_30B}", *overrides], environ={}), {})


def qwen3_30b() -> HFModelDims:
    return HFModelDims.from_hf_config(json.loads((QWEN3_30B / "config.json").read_text()))


# ---------------------------------------------------------------- hand calculation

# Qwen3-30B-A3B (tests/fixtures/models/qwen3-30b-a3b/config.json): hidden 2048, 32 query heads
# and 4 KV heads of 128, 48 layers, 128 experts of FFN 768, vocabulary 151,936, untied.
DENSE = (151936 * 2048 * 2                                         # embedding + output layer
         + 48 * (2 * 2048 * 4096 + 2 * 2048 * 512                  # q, o; k, v
                 + 2 * 2048 + 2 * 128 + 128 * 2048)                # norms, q/k norms, router
         + 2048)                                                   # final norm
EXPERTS = 48 * 128 * 3 * 2048 * 768


def test_the_hand_counts_are_the_estimates_counts():
    assert parameter_counts(qwen3_30b()) == (DENSE, EXPERTS)


@pytest.mark.parametrize("world,ep,fraction", [(8, 8, 0.5), (4, 4, 1.0), (16, 8, 0.25)])
def test_offload_arithmetic_matches_a_hand_calculation(world, ep, fraction):
    """Per rank the optimizer shard is D/dp + X/ep/expert-dp parameters; the offloaded share
    leaves 12 B each on the GPU for 24 B each on the host (12 of state, the pinned 4 B fp32
    gradient and 2 B bf16 staging counted twice), moves 8 B over PCIe and 28 B of CPU AdamW
    traffic per step: 25 GB/s per GPU and 200 GB/s per node are the stated assumptions."""
    d = qwen3_30b()
    dp, edp, node_ranks = world, world // ep, min(world, 8)
    shard = DENSE / dp + EXPERTS / ep / edp
    offloaded = fraction * shard
    plan = MemoryPlan(world_size=world, ep=ep, tokens=40960, recompute=True, offload_fraction=fraction)
    on, off = estimate(d, plan), estimate(d, MemoryPlan(world_size=world, ep=ep, tokens=40960, recompute=True))
    assert off.static_bytes - on.static_bytes == pytest.approx(12 * offloaded)
    assert on.activation_bytes == off.activation_bytes
    host = host_estimate(d, plan)
    assert host.offloaded_parameters == pytest.approx(offloaded)
    assert host.offload_bytes == pytest.approx(node_ranks * offloaded * 24)
    assert host.pcie_seconds == pytest.approx(offloaded * 8 / 25e9)
    assert host.cpu_adam_seconds == pytest.approx(node_ranks * offloaded * 28 / 200e9)
    assert host.snapshot_bytes == pytest.approx(2 * (DENSE + EXPERTS) * 2)  # two bf16 versions on rank 0
    # the checkpoint on node 0's host: each rank copies its own optimizer shard (nothing gathered), and
    # the writer of each (tp, ep) pair, expert-DP rank 0 (the first ep ranks), its bf16 weights
    gather = node_ranks * shard * 12 + min(ep, node_ranks) * (DENSE + EXPERTS / ep) * 2
    assert host.checkpoint_bytes == pytest.approx(gather)
    assert host_estimate(d, MemoryPlan(world_size=world, ep=ep)).offload_bytes == 0


def test_the_two_node_figures_by_hand():
    """configs/...-2x8-80gb.yaml: 8 ranks, ep 8, half the shard offloaded. Static per GPU
    = D (2 + 4 + 12 x 0.5 / 8) + X / 8 (2 + 4 + 12 x 0.5) = 10.4 + 43.5 = 53.9 GB."""
    c = check(TWO_NODES)
    static = DENSE * (6 + 6 / 8) + EXPERTS / 8 * (6 + 6)
    assert c.result.static_bytes == pytest.approx(static)
    assert round(static / GB, 1) == 53.9
    offloaded = 0.5 * (DENSE / 8 + EXPERTS / 8)                    # 1.91e9 per rank
    assert c.host.offload_bytes == pytest.approx(8 * offloaded * 24)   # 366 GB on node A
    assert round(c.host.step_seconds, 1) == round(offloaded * 8 / 25e9 + 8 * offloaded * 28 / 200e9, 1) == 2.7


# ---------------------------------------------------------------- the shipped configs


@pytest.mark.parametrize("path,world,ep,gpu_gb,host_gb", [
    (ONE_NODE, 4, 4, 74.5, 1292),
    (TWO_NODES, 8, 8, 75.7, 938),
    (TWO_NODES_H200, 8, 8, 98.6, 571),
], ids=lambda v: v.name if isinstance(v, Path) else None)
def test_each_cluster_config_passes_the_check_with_these_figures(path, world, ep, gpu_gb, host_gb):
    """The figures of docs/operations.md's cluster table and of the files' headers."""
    c = check(path)
    assert c.skipped is None and c.fits, c.report()
    c.refuse()
    assert (c.plan.world_size, c.plan.ep) == (world, ep)
    assert round(c.result.total_gb, 1) == gpu_gb and round(c.host.total_gb) == host_gb
    assert "fits" in c.report().splitlines()[0] and len(c.report().splitlines()) == 2
    (row,) = [ln for ln in DOCS.read_text().splitlines() if ln.startswith(f"| `{path.name}`")]
    assert f"| {gpu_gb} GB (" in row and f"| {host_gb:,} GB (" in row
    assert f"{gpu_gb} GB" in path.read_text()  # the header's figure


@pytest.mark.parametrize("path,without_gb", [(ONE_NODE, 166.1), (TWO_NODES, 98.6)],
                         ids=["1x8-80gb", "2x8-80gb"])
def test_the_80gb_configs_need_the_offload(path, without_gb):
    """The negative control: the same files with the offload off cannot fit 80 GB."""
    c = check(path, "consumer.optimizer.cpu_offload_fraction=0")
    assert not c.gpu_fits and round(c.result.total_gb, 1) == without_gb
    assert "DOES NOT FIT 80 GB" in c.report()
    with pytest.raises(ConfigError, match="cpu_offload_fraction") as e:
        c.refuse()
    assert e.value.key == "consumer.memory.device_memory_gb"


def test_the_one_node_config_needs_a_2tb_node():
    """Offloading everything moves 733 GB to the host: on a 1 TB node the host check refuses it."""
    c = check(ONE_NODE, "consumer.memory.host_memory_gb=1000")
    assert c.gpu_fits and not c.host_fits and "DOES NOT FIT 1000 GB" in c.report()
    with pytest.raises(ConfigError, match=r"~1292 GB of host memory") as e:
        c.refuse()
    assert e.value.key == "consumer.memory.host_memory_gb"
    unset = check(ONE_NODE, "consumer.memory.host_memory_gb=null")
    assert unset.fits and "not checked" in unset.report()


# ---------------------------------------------------------------- the setting


@pytest.mark.parametrize("bad", [["consumer.optimizer.distributed=false"], ["consumer.optimizer.name=sgd"]])
def test_the_offload_needs_the_distributed_adamw(bad):
    with pytest.raises(ConfigError, match="cpu_offload_fraction 0.5 needs name: adamw") as e:
        load_config(None, ["consumer.optimizer.cpu_offload_fraction=0.5", *bad], environ={})
    assert e.value.key.startswith("consumer.optimizer")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["consumer.optimizer.cpu_offload_fraction=1.5"], environ={})
    assert e.value.key == "consumer.optimizer.cpu_offload_fraction"


def _megatron_config(settings: OptimizerSettings):
    from types import SimpleNamespace

    from rlstream.consumer.train.optimizer import _megatron_config

    return _megatron_config(settings, SimpleNamespace(bf16=True, params_dtype=torch.bfloat16), True)


def test_the_setting_reaches_megatron_cores_optimizer_config():
    on = _megatron_config(OptimizerSettings(cpu_offload_fraction=0.5, cpu_offload_overlap=True))
    assert on.optimizer_cpu_offload and on.optimizer_offload_fraction == 0.5
    assert on.overlap_cpu_optimizer_d2h_h2d is True
    assert on.use_precision_aware_optimizer  # the path Megatron's offload runs on
    assert on.main_params_dtype == on.exp_avg_dtype == on.exp_avg_sq_dtype == torch.float32
    off = _megatron_config(OptimizerSettings())
    assert not off.optimizer_cpu_offload and not off.use_precision_aware_optimizer


def test_megatron_builds_its_hybrid_device_optimizer_from_the_setting(monkeypatch):
    """megatron-core's own factory, stopped where it builds the offloading optimizer (the
    real one takes CUDA streams): the fraction, overlap and AdamW settings arrive."""
    import megatron.core.optimizer as mopt

    built = {}

    class Reached(Exception):
        pass

    def hybrid(param_groups, **kwargs):
        built.update(kwargs, groups=param_groups)
        raise Reached

    monkeypatch.setattr(mopt, "HybridDeviceOptimizer", hybrid)
    cfg = _megatron_config(OptimizerSettings(lr=3e-6, cpu_offload_fraction=0.75, betas=(0.9, 0.95)))
    groups = [{"params": [torch.nn.Parameter(torch.zeros(4))]}]
    with pytest.raises(Reached):
        mopt._get_megatron_optimizer_based_on_param_groups(cfg, model_chunks=[], param_groups=groups)
    assert built["offload_fraction"] == 0.75 and built["overlap_cpu_optimizer_d2h_h2d"] is False
    assert built["cpu_optimizer_cls"] is torch.optim.AdamW and built["param_update_in_fp32"] is True
    assert (built["lr"], built["betas"]) == (3e-6, (0.9, 0.95)) and built["groups"] is groups


def test_the_offload_is_refused_without_a_gpu(monkeypatch):
    from rlstream.consumer.train.optimizer import TrainerOptimizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device") as e:
        TrainerOptimizer(None, OptimizerSettings(cpu_offload_fraction=0.5))  # before the model is touched
    assert e.value.key == "consumer.optimizer.cpu_offload_fraction"


# ---------------------------------------------------------------- the pod limit


def test_the_k8s_consumer_is_checked_against_its_pods_memory_limit(tmp_path):
    """The ConfigMap's host_memory_gb is the consumer pod's limits.memory, and its ranks per
    node are the JobSet's torchrun --nproc_per_node: node 0's ~388 GB fit the 1024Gi limit."""
    from tests.support.shipped_manifests import container, find, torchrun_world

    consumer = find("JobSet", "rlstream-consumer")
    limit = container(consumer)["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    limit_gb = int(limit[:-2]) * 2**30 / 1e9
    cm = tmp_path / "rlstream.yaml"
    cm.write_text(find("ConfigMap", "rlstream-config")["data"]["rlstream.yaml"])
    cfg = load_config(cm, [f"model.path={QWEN3_30B}"], environ={"RLSTREAM__KAFKA__SASL_PLAIN_PASSWORD": "x"})
    host_gb = cfg.consumer.memory.host_memory_gb
    assert host_gb is not None and limit_gb - 1 < host_gb <= limit_gb
    assert cfg.consumer.memory.ranks_per_node == torchrun_world(consumer)[1]
    c = check_config(cfg, {})
    assert c.fits and round(c.host.total_gb) == 388 and f"fits {host_gb:g} GB" in c.report().splitlines()[1]
