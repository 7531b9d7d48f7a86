"""Weight versions for the collective-path tests: HF tensors, as a vLLM WeightSource, on disk.

    base = read_weights(model_dir)
    w1 = perturbed(base, seed=1)                     # another version of the same model
    source = DictSource(w1)                          # what a trainer would stream
    d = write_version(tmp / "w1", w1, model_dir)     # the same version as an HF directory (file path)
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch


def read_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def perturbed(base: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous() for k, v in base.items()}


def write_version(dst: Path, tensors: dict[str, torch.Tensor], model_dir) -> Path:
    """An HF directory of `tensors` beside the model's config and tokenizer."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def dict_source(tensors: dict[str, torch.Tensor]):
    """A vLLM WeightSource over an HF dict: groups are vLLM's `layerwise_groups` of its names."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            yield from tensors.items()

    return DictSource()
