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


class TrainerSide:
    """The trainer's sending half (consumer/weights/sender.py, consumer/weights/engines.py, consumer/weights/durable.py),
    fed versions by the test instead of a training loop.

        trainer = TrainerSide(tmp / "store", model_dir)
        msg = trainer.publish(1, tensors, durable=True)   # WeightsReady(transport=collective, ...)
    """

    def __init__(self, store_dir: Path, model_dir, timeout_s: float = 20.0, writer=None):
        from common.config import WeightSyncSettings
        from common.weights.store import WeightStore
        from consumer.weights.sender import WeightSender

        self.sender = WeightSender(WeightSyncSettings(timeout_s=timeout_s))
        self.store = WeightStore(store_dir, keep=20)
        self.model_dir, self.writer = model_dir, writer
        self.snapshot = None
        self.durable = None

    def publish(self, version: int, tensors: dict, durable: bool = False, snapshot_cls=None):
        """Stream `tensors` as `version` to every link; announce it (through `writer` when set)."""
        from common.control.messages import DurableCopy, WeightsReady
        from consumer.weights.engines import Snapshot

        snap = (snapshot_cls or Snapshot)(version, dict_source(tensors), reuse=self.snapshot)
        self.sender.publish(snap)
        snap.fill()
        self.snapshot = snap
        if durable:
            m = self.store.write(version, tensors, self.model_dir)
            self.durable = DurableCopy(version, m["uri"], m["sha256"], m["bytes"])
        d = self.durable
        extra = {} if d is None else dict(durable_version=d.version, durable_uri=d.uri, durable_sha256=d.sha256,
                                          durable_bytes=d.bytes)
        msg = WeightsReady(version=version, transport="collective", digest=snap.digest,
                           endpoint=self.sender.endpoint, **extra)
        if self.writer is not None:
            self.writer.announce(msg)
        return msg

    def close(self) -> None:
        self.sender.close()
