"""Start-up (consumer/train/loader.py): each rank reads only the tensors it keeps.

Against the loader it replaces (read every tensor, convert the whole model,
then cut the rank's shard: `shard_megatron(hf_to_megatron(...))`), for every
rank of dp2+ep2, tp2, tp2+ep2 and ep4, on the tied and untied tiny model and on
a checkpoint split over two files with an index: the same tensors, bit for
bit, and a rank never reads a byte of another rank's experts or TP slices.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlstream.consumer.train import layout as names
from rlstream.consumer.train.loader import ShardReader, read_rank_shard
from rlstream.consumer.train.model import read_hf_dims

pytestmark = [pytest.mark.megatron]

# layout -> (tp, ep); data-parallel copies of a (tp rank, ep rank) read the same shard
LAYOUTS = {"dp2_ep2": (1, 2), "tp2": (2, 1), "tp2_ep2": (2, 2), "ep4": (1, 4)}


@pytest.fixture(scope="module")
def split_dir(perturbed_dirs, tmp_path_factory):
    """The untied model over two safetensors files and an index (as HF ships 30B)."""
    from safetensors.torch import load_file, save_file

    src = Path(perturbed_dirs["untied"])
    dst = tmp_path_factory.mktemp("split")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    keys = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in parts.items():
        save_file({k: sd[k] for k in ks}, str(dst / name), metadata={"format": "pt"})
    index = {"weight_map": {k: name for name, ks in parts.items() for k in ks}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def model_dirs(perturbed_dirs, split_dir):
    return {"untied": perturbed_dirs["untied"], "tied": perturbed_dirs["tied"], "split": split_dir}


@pytest.mark.parametrize("which", ["untied", "tied", "split"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_exactly_the_shard_the_old_loader_kept(perturbed_dirs, split_dir, which, layout):
    d = model_dirs(perturbed_dirs, split_dir)[which]
    dims = read_hf_dims(d)
    full = names.hf_to_megatron(names.read_hf_safetensors(d), dims)
    tp, ep = LAYOUTS[layout]
    read_by_rank = {}
    for tp_rank in range(tp):
        for ep_rank in range(ep):
            want = names.shard_megatron(full, dims, tp_rank, tp, ep_rank, ep)
            reader = ShardReader(d)
            got = read_rank_shard(reader, dims, tp_rank, tp, ep_rank, ep)
            reader.close()
            assert set(got) == set(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
            # it read exactly what it keeps: not a byte more
            assert reader.bytes_read == sum(t.numel() * t.element_size() for t in want.values())
            read_by_rank[(tp_rank, ep_rank)] = reader.keys_read
    # no rank opened another expert-parallel rank's experts
    per_rank = dims.num_experts // ep
    for (_, ep_rank), keys in read_by_rank.items():
        experts = {int(k.split(".")[5]) for k in keys if ".mlp.experts." in k}
        assert experts == set(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)), (ep_rank, experts)


def test_a_rank_reads_a_fraction_of_the_checkpoint(perturbed_dirs):
    """ep4: dense weights + a quarter of the experts; tp2: about half of everything."""
    d = perturbed_dirs["untied"]
    dims = read_hf_dims(d)
    total = sum(t.numel() * t.element_size() for t in names.read_hf_safetensors(d).values())
    shares = {}
    for name, (tp, ep) in (("ep4", (1, 4)), ("tp2", (2, 1))):
        reader = ShardReader(d)
        read_rank_shard(reader, dims, 0, tp, 0, ep)
        reader.close()
        shares[name] = reader.bytes_read / total
    assert shares["ep4"] < 0.6 and shares["tp2"] < 0.6, shares


def test_a_checkpoint_that_does_not_match_the_config_is_refused(perturbed_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from rlstream.common.errors import ModelError

    src = Path(perturbed_dirs["untied"])
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.1.mlp.experts.7.down_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="experts.7.down_proj"):
        read_rank_shard(ShardReader(tmp_path), read_hf_dims(src), 0, 1, 0, 2)
