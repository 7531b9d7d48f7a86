"""Session fixtures for the trainer area (see tests/conftest.py).

Expensive things are built once: Megatron's parallel state (world of one,
gloo), perturbed copies of the tiny model (so norms are not all ones and the
router is decisive enough for parity tests to mean something), and rollouts
sampled from a bf16 Megatron copy of the model with its routing recorded -
the CPU stand-in for "vLLM in bf16 with routing capture".
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

# ---------------------------------------------------------------- helpers


def perturb_checkpoint(src: Path, dst: Path, seed: int = 1, router_scale: float = 20.0) -> Path:
    """Copy an HF dir, adding noise to every tensor (norms become 1 + noise) and
    scaling the router so routing is not a near-tie everywhere."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        noise = torch.randn(v.shape, generator=g, dtype=v.dtype)
        if k.endswith("norm.weight"):
            v = 1.0 + 0.3 * noise
        elif k.endswith("mlp.gate.weight"):
            v = v * router_scale
        else:
            v = v + 0.02 * noise
        out[k] = v.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def sharpen_checkpoint(src: Path, dst: Path, lm_head: float = 10.0, experts: float = 3.0,
                       router: float = 5.0) -> Path:
    """Copy an HF dir with scaled lm_head, expert and router weights: the random
    tiny model is nearly uniform and its experts barely matter; scaled, its
    outputs are peaked (entropy ~2.4 nats vs ln 64 = 4.16) and routing changes
    move the log-probabilities, as in a trained MoE."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    for k in sd:
        if k == "lm_head.weight":
            sd[k] = sd[k] * lm_head
        elif ".mlp.experts." in k:
            sd[k] = sd[k] * experts
        elif k.endswith("mlp.gate.weight"):
            sd[k] = sd[k] * router
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def sample_rollouts(model, n_groups: int, group_size: int, seed: int = 0,
                    max_new: int = 10, temperature: float = 1.0) -> list:
    """Sample responses from `model` (a Megatron GPTModel, any dtype), then one
    recording forward gives mu_old log-probabilities and the routing of every
    input position ([P+T-1, L, K], uint8), like a routed-experts rollout."""
    import torch

    from consumer import replay
    from consumer.batch import TrainSample
    from consumer.model import forward_logits, logprobs_from_logits

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.hf_dims.vocab_size
    samples = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(4, 9)))
        seq = torch.from_numpy(np.tile(prompt, (group_size, 1))).long()
        with torch.no_grad():
            for _ in range(max_new):
                probs = torch.softmax(forward_logits(model, seq)[:, -1] / temperature, -1)
                seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
            with replay.recording(model) as rec:
                lp = logprobs_from_logits(forward_logits(model, seq[:, :-1]), seq[:, 1:])
        routing = replay.from_layer_indices(rec["layers"], group_size)
        p = len(prompt)
        for j in range(group_size):
            t = int(rng.integers(3, max_new + 1))  # responses of varied length
            samples.append(TrainSample(
                prompt_ids=prompt.astype(np.int32),
                response_ids=seq[j, p:p + t].numpy().astype(np.int32),
                logprobs=lp[j, p - 1:p - 1 + t].float().numpy(),
                reward=float(rng.integers(0, 2)), group_id=f"g{seed}-{g}",
                routed_experts=routing[j, :p + t - 1].numpy().astype(np.uint8)))
    return samples


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world 1) + Megatron parallel state, once."""
    import torch

    from consumer.parallel import ParallelLayout, init_parallel

    torch.set_num_threads(2)
    init_parallel(ParallelLayout())
    return ParallelLayout()


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    from common.toy.tinymodel import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied"),
                            TinyModelSpec(tie_word_embeddings=True))


@pytest.fixture(scope="session")
def perturbed_dirs(tiny_model_dir, tied_model_dir, tmp_path_factory):
    """{"untied": dir, "tied": dir}: perturbed copies of the tiny model."""
    root = tmp_path_factory.mktemp("tiny-perturbed")
    return {"untied": perturb_checkpoint(tiny_model_dir, root / "untied"),
            "tied": perturb_checkpoint(tied_model_dir, root / "tied", seed=2)}


@pytest.fixture(scope="session")
def sharp_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with peaked outputs and experts that matter (see sharpen_checkpoint)."""
    return sharpen_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("tiny-sharp") / "m")


@pytest.fixture(scope="session")
def bf16_rollouts(megatron_world, sharp_model_dir):
    """8 groups x 4 responses sampled from the bf16 Megatron `sharp_model_dir`
    model, with mu_old log-probs and routing recorded (the CPU stand-in for
    bf16 vLLM with routing capture)."""
    import torch

    from consumer.model import load_hf_checkpoint

    inference = load_hf_checkpoint(sharp_model_dir, dtype=torch.bfloat16)
    inference.eval()
    return sample_rollouts(inference, n_groups=8, group_size=4, seed=0)


def hf_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
