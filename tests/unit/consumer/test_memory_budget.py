"""consumer/train/memory_budget.py and memory_check.py: the arithmetic of
docs/trainer-scale.md ("Static memory per GPU", "Activations per micro-batch") on
Qwen3-30B-A3B's published architecture (tests/fixtures/models/qwen3-30b-a3b/config.json, written from the numbers in the doc:
nothing downloaded), the two settings that drive it, and every shipped GPU config
against its declared device memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlstream.common.config import load_config
from rlstream.common.errors import ConfigError
from rlstream.consumer.train.memory_budget import (
    GB,
    MemoryPlan,
    estimate,
    layer_working_elements,
    parameter_counts,
)
from rlstream.consumer.train.memory_check import check_config
from rlstream.consumer.train.model import HFModelDims

ROOT = Path(__file__).resolve().parents[3]
QWEN3_30B = ROOT / "tests" / "fixtures" / "models" / "qwen3-30b-a3b"
GPU_CONFIGS = sorted((ROOT / "configs").glob("qwen3-30b-a3b-*.yaml"))
MULTI_NODE_CONFIGS = [p for p in GPU_CONFIGS if yaml.safe_load(p.read_text())["consumer"]["parallel"]["world_size"] > 8]
TWO_NODE_H200 = ROOT / "configs" / "qwen3-30b-a3b-onpolicy-bf16-2x8-h200.yaml"
SECRETS = {"RLSTREAM__KAFKA__SASL_PLAIN_PASSWORD": "x"}  # the configmap's SASL password comes from a Secret


def qwen3_30b() -> HFModelDims:
    return HFModelDims.from_hf_config(json.loads((QWEN3_30B / "config.json").read_text()))


def configmap_file(tmp_path: Path) -> Path:
    docs = yaml.safe_load_all((ROOT / "ops" / "k8s" / "configmap.yaml").read_text())
    (cm,) = [d for d in docs if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rlstream-config"]
    f = tmp_path / "rlstream.yaml"
    f.write_text(cm["data"]["rlstream.yaml"])
    return f


def test_parameter_counts_match_the_doc():
    dense, experts = parameter_counts(qwen3_30b())
    assert round(dense / 1e9, 3) == 1.541 and round(experts / 1e9, 2) == 28.99
    assert round((dense + experts) / 1e9, 2) == 30.53


@pytest.mark.parametrize("world,ep,distributed,dense_gb,experts_gb,static_gb", [
    (8, 8, True, 11.6, 65.2, 76.8),
    (16, 8, True, 10.4, 43.5, 53.9),
    (32, 8, True, 9.8, 32.6, 42.4),
    (32, 16, True, 9.8, 21.7, 31.6),
    (8, 8, False, None, None, 93.0),     # "any, no distributed optimizer (18 B/param), ep 8"
    (32, 8, False, None, None, 93.0),
])
def test_static_memory_reproduces_the_doc_table(world, ep, distributed, dense_gb, experts_gb, static_gb):
    est = estimate(qwen3_30b(), MemoryPlan(world_size=world, ep=ep, distributed=distributed))
    assert round(est.static_bytes / GB, 1) == static_gb
    if dense_gb is not None:
        assert (round(est.dense_bytes / GB, 1), round(est.expert_bytes / GB, 1)) == (dense_gb, experts_gb)


def test_activations_reproduce_the_doc():
    """One 40,960-position micro-batch with recompute: 8.1 GB of saved layer inputs, a
    recomputed layer of ~150 KB/position (~6 GB), a 3.1 GB logits chunk: about 17 GB;
    without recompute ~300 GB (a layer keeps ~150-180 KB/position x 48 layers)."""
    d = qwen3_30b()
    assert abs(layer_working_elements(d) * 2 / 1e3 - 150) < 1.5
    plan = MemoryPlan(world_size=32, ep=8, tokens=40960, logprob_chunk_tokens=2048, recompute=True)
    act = estimate(d, plan).activation_bytes / GB
    assert 16.5 < act < 17.5
    per_layer_off = estimate(d, MemoryPlan(world_size=32, ep=8, tokens=1, logprob_chunk_tokens=1))
    assert 7.0e6 <= (per_layer_off.activation_bytes - d.vocab_size * 10) <= 8.6e6  # ~7-8.6 MB/position
    no_recompute = estimate(d, MemoryPlan(world_size=32, ep=8, tokens=40960, recompute=False))
    assert 280 < no_recompute.activation_bytes / GB < 320
    whole = estimate(d, MemoryPlan(world_size=32, ep=8, tokens=40960, logprob_chunk_tokens=0, recompute=True))
    assert whole.activation_bytes - estimate(d, plan).activation_bytes == pytest.approx(
        (40960 - 2048) * d.vocab_size * 10)


@pytest.mark.parametrize("world", [16, 32], ids=["k8s-16-ranks", "recipes-32-ranks"])
def test_expert_imbalance_grows_the_activation_estimate(world):
    """N8: the dispatcher is dropless with no balancing loss, so the busiest expert-parallel
    rank holds more than K copies of each position. The imbalance factor scales exactly the
    expert terms (2 K H + 4 K F) of the one recomputed layer; static memory is unchanged."""
    d = qwen3_30b()
    ests = {f: estimate(d, MemoryPlan(world_size=world, ep=8, tokens=40960, recompute=True, expert_imbalance=f))
            for f in (1.0, 1.5, 2.0, 3.0)}
    acts = [e.activation_bytes for e in ests.values()]
    assert acts == sorted(acts) and len(set(acts)) == len(acts)
    assert len({e.static_bytes for e in ests.values()}) == 1
    expert_bytes_per_position = (2 * d.topk * d.hidden_size + 4 * d.topk * d.moe_ffn_hidden_size) * 2
    assert ests[2.0].activation_bytes - ests[1.0].activation_bytes == pytest.approx(40960 * expert_bytes_per_position)
    assert round(ests[1.0].total_gb, 1) == {16: 71.2, 32: 59.7}[world]  # the doc's balanced figures
    assert ests[2.0].fits(80.0)
    # at 3x the 16-rank layout (the k8s ConfigMap) no longer fits 80 GB; 32 ranks still do
    assert ests[3.0].fits(80.0) is (world == 32)


def test_the_config_sets_the_imbalance_factor():
    path = GPU_CONFIGS[0]
    default = check_config(load_config(path, [f"model.path={QWEN3_30B}"], environ={}), {})
    assert default.plan.expert_imbalance == 1.5 and "expert imbalance 1.5" in default.report()
    hot = check_config(load_config(path, [f"model.path={QWEN3_30B}", "consumer.memory.expert_imbalance=3"],
                                   environ={}), {})
    assert hot.result.activation_bytes > default.result.activation_bytes
    with pytest.raises(ConfigError) as e:
        load_config(path, ["consumer.memory.expert_imbalance=0.5"], environ={})  # below balance is no margin
    assert e.value.key == "consumer.memory.expert_imbalance"


@pytest.mark.parametrize("world,total_gb,fits", [(16, 71, True), (32, 60, True), (8, 94, False)])
def test_totals_match_the_doc_verdicts(world, total_gb, fits):
    est = estimate(qwen3_30b(), MemoryPlan(world_size=world, ep=8, tokens=40960, recompute=True))
    assert abs(est.total_gb - total_gb) < 1 and est.fits(80.0) is fits


@pytest.mark.parametrize("path", GPU_CONFIGS + ["ops/k8s/configmap.yaml"], ids=lambda p: Path(p).name)
def test_every_shipped_gpu_config_fits_its_declared_memory(path, tmp_path):
    f = configmap_file(tmp_path) if str(path).endswith("configmap.yaml") else path
    cfg = load_config(f, [f"model.path={QWEN3_30B}"], environ=SECRETS)
    assert cfg.consumer.parallel.world_size and cfg.consumer.memory.device_memory_gb
    check = check_config(cfg, {})
    assert check.skipped is None and check.plan.world_size == cfg.consumer.parallel.world_size
    assert check.fits, check.report()
    check.refuse()  # no error
    assert f"fits {cfg.consumer.memory.device_memory_gb:g} GB" in check.report()


def test_the_two_node_config_needs_h200s():
    """configs/...-2x8-h200.yaml trains on one node of 8 GPUs: 98.6 GB per GPU (76.8 static,
    2.1 of weight transfer on rank 0), which fits an H200 and is refused on an 80 GB H100."""
    cfg = load_config(TWO_NODE_H200, [f"model.path={QWEN3_30B}"], environ={})
    check = check_config(cfg, {})
    assert check.fits and round(check.result.total_gb, 1) == 98.6 and cfg.consumer.parallel.world_size == 8
    h100 = check_config(load_config(TWO_NODE_H200, [f"model.path={QWEN3_30B}", "consumer.memory.device_memory_gb=80"],
                                    environ={}), {})
    assert not h100.fits and "DOES NOT FIT 80 GB" in h100.report()


@pytest.mark.parametrize("path", MULTI_NODE_CONFIGS, ids=lambda p: p.name)
def test_the_recipes_refuse_eight_gpus(path):
    """The negative control: the same files on one node of 8 GPUs cannot fit (76.8 GB static)."""
    cfg = load_config(path, [f"model.path={QWEN3_30B}", "consumer.parallel.world_size=8"], environ={})
    check = check_config(cfg, {})
    assert not check.fits and "DOES NOT FIT" in check.report()
    with pytest.raises(ConfigError, match=r"~98\.\d GB per GPU .* static 76\.8 GB.*add ranks") as e:
        check.refuse()
    assert e.value.key == "consumer.memory.device_memory_gb"


def test_the_launched_world_size_wins_and_the_check_is_optional():
    path = GPU_CONFIGS[0]
    cfg = load_config(path, [f"model.path={QWEN3_30B}", "consumer.parallel.world_size=8"], environ={})
    assert check_config(cfg, {"WORLD_SIZE": "32"}).fits
    assert check_config(load_config(path, ["consumer.memory.device_memory_gb=null"], environ={}), {}) is None
    assert "world_size is not set" in check_config(
        load_config(path, ["consumer.parallel.world_size=null"], environ={}), {}).skipped
    skipped = check_config(load_config(path, ["model.path=/nonexistent/model"], environ={}), {})
    assert skipped.fits and "/nonexistent/model/config.json is not readable" in skipped.report()


def test_declared_world_size_is_checked_against_torchrun_and_the_layout():
    cfg = load_config(None, ["consumer.parallel.expert=8", "consumer.parallel.world_size=16"],
                      environ={"WORLD_SIZE": "16"})
    assert cfg.consumer.parallel.data_parallel(16) == 16
    with pytest.raises(ConfigError, match="written for 16 ranks but torchrun's WORLD_SIZE is 32") as e:
        load_config(None, ["consumer.parallel.world_size=16"], environ={"WORLD_SIZE": "32"})
    assert e.value.key == "consumer.parallel.world_size"
    with pytest.raises(ConfigError, match="expert=8 does not fit 12 ranks") as e:
        load_config(None, ["consumer.parallel.expert=8", "consumer.parallel.world_size=12"], environ={})
    assert e.value.key == "consumer.parallel.world_size"
    with pytest.raises(ConfigError, match="written for 16 ranks"):  # the loader's own check, WORLD_SIZE known late
        cfg.consumer.parallel.data_parallel(8)
    for bad in ("consumer.parallel.world_size=0", "consumer.memory.device_memory_gb=0"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [bad], environ={})
        assert e.value.key == bad.split("=")[0]


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM") and k != "WORLD_SIZE"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "rlstream.cli", "consumer", "--dry-run", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_dry_run_prints_the_estimate_skips_without_the_model_and_refuses_a_misfit():
    path = str(GPU_CONFIGS[0])
    ok = _dry_run("-c", path, "--set", f"model.path={QWEN3_30B}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "# memory check (docs/trainer-scale.md): 32 ranks, tp 1, ep 8, dp 32" in ok.stdout
    assert "static 42.4 GB" in ok.stdout and "fits 80 GB" in ok.stdout
    yaml.safe_load(ok.stdout)  # still YAML: the estimate is a comment
    absent = _dry_run("-c", path)  # /models/... is not on this machine (nor on CI)
    assert absent.returncode == 0 and "# memory check skipped: /models/" in absent.stdout
    misfit = _dry_run("-c", path, "--set", f"model.path={QWEN3_30B}", "--set", "consumer.parallel.world_size=8")
    assert misfit.returncode == 2 and "consumer.memory.device_memory_gb" in misfit.stderr
    assert "DOES NOT FIT 80 GB" in misfit.stdout


@pytest.mark.parametrize("overrides,transfer", [
    ([], 2 * 2**30),                                          # the shipped nccl collective path
    (["consumer.weights.backend=auto"], 2 * 2**30),           # auto is nccl on a GPU
    (["consumer.weights.backend=rlstream_gloo", "producer.engine.weight_transfer=rlstream_gloo"], 0),
    (["consumer.weights.transport=file"], 0),
], ids=["nccl", "auto", "gloo", "file"])
def test_rank_0s_weight_transfer_buffers_are_counted_on_nccl_only(overrides, transfer):
    """Rank 0 uploads each version through vLLM's packed nccl broadcast, a 2 x 1 GiB double
    buffer on its GPU (vllm/distributed/weight_transfer/packed_tensor.py defaults); gloo sends
    from host memory and transport: file only writes the store."""
    from vllm.distributed.weight_transfer.packed_tensor import (DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                                                                DEFAULT_PACKED_NUM_BUFFERS)

    assert DEFAULT_PACKED_BUFFER_SIZE_BYTES * DEFAULT_PACKED_NUM_BUFFERS == 2 * 2**30  # vLLM's geometry
    path = GPU_CONFIGS[0]
    c = check_config(load_config(path, [f"model.path={QWEN3_30B}", *overrides], environ={}), {})
    assert c.plan.weight_transfer_bytes == c.result.transfer_bytes == transfer
    unsent = estimate(qwen3_30b(), MemoryPlan(**{**c.plan.__dict__, "weight_transfer_bytes": 0.0}))
    assert c.result.total_gb - unsent.total_gb == pytest.approx(transfer / GB)
    assert ("weight transfer 2.1 GB (rank 0)" in c.report()) is bool(transfer)
