"""The memory check of a config: the arithmetic of consumer/train/memory_budget.py on the
trainer's settings and the model's config.json, against consumer.memory's device and host.

    check = check_config(cfg, os.environ)            # from the settings and model.path
    print(check.report())                            # --dry-run; check.refuse() at start

No torch import, so `--dry-run` stays fast; reading config.json goes through
consumer/train/model.py only when the file exists.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlstream.common.errors import ConfigError
from rlstream.consumer.train.memory_budget import (
    WEIGHT_TRANSFER_GPU_BYTES,
    HostEstimate,
    MemoryEstimate,
    MemoryPlan,
    estimate,
    host_estimate,
)

if TYPE_CHECKING:
    from rlstream.common.config import RlstreamConfig


@dataclass(frozen=True)
class MemoryCheck:
    """The check of one config: an estimate against the device, or why it was skipped."""

    device_gb: float | None
    plan: MemoryPlan | None = None
    result: MemoryEstimate | None = None
    skipped: str | None = None
    host: HostEstimate | None = None
    host_gb: float | None = None
    """consumer.memory.host_memory_gb (None: the host estimate is printed, not checked)."""

    @property
    def gpu_fits(self) -> bool:
        return self.result is None or self.result.fits(self.device_gb)

    @property
    def host_fits(self) -> bool:
        return self.host is None or self.host.fits(self.host_gb)

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits

    def report(self) -> str:
        """Two lines for `--dry-run`, GPU then host (YAML comments: the output stays YAML)."""
        if self.result is None:
            return f"# memory check skipped: {self.skipped}"
        p, verdict = self.plan, "fits" if self.gpu_fits else "DOES NOT FIT"
        offload = f", optimizer offload {p.offload_fraction:g}" if p.offload_fraction else ""
        gpu = (f"# memory check (docs/trainer-scale.md): {p.world_size} ranks, tp {p.tp}, ep {p.ep}, "
               f"dp {p.dp}, expert imbalance {p.expert_imbalance:g}{offload}: {self.result.summary()}; "
               f"{verdict} {self.device_gb:g} GB")
        host_verdict = ("not checked (consumer.memory.host_memory_gb unset)" if self.host_gb is None else
                        f"{'fits' if self.host_fits else 'DOES NOT FIT'} {self.host_gb:g} GB")
        return (f"{gpu}\n# host memory ({p.node_ranks} trainer ranks per node): {self.host.summary()}; "
                f"{host_verdict}")

    def refuse(self) -> None:
        """Raise ConfigError with the numbers and what to change when the layout cannot fit."""
        if not self.gpu_fits:
            raise ConfigError(
                f"the trainer needs ~{self.result.total_gb:.1f} GB per GPU ({self.result.summary()}) "
                f"but consumer.memory.device_memory_gb is {self.device_gb:g}: add ranks (world_size, so "
                "the distributed optimizer shards more), raise consumer.parallel.expert or tensor, turn "
                "on consumer.memory.recompute, lower micro_batch_tokens / logprob_chunk_tokens, or "
                "offload optimizer state (consumer.optimizer.cpu_offload_fraction; docs/trainer-scale.md)",
                key="consumer.memory.device_memory_gb")
        if not self.host_fits:
            raise ConfigError(
                f"trainer node 0 needs ~{self.host.total_gb:.0f} GB of host memory ({self.host.summary()}) "
                f"but consumer.memory.host_memory_gb is {self.host_gb:g}: lower "
                "consumer.optimizer.cpu_offload_fraction, or spread the ranks over more nodes "
                "(consumer.memory.ranks_per_node; docs/trainer-scale.md)", key="consumer.memory.host_memory_gb")


def plan_of(cfg: "RlstreamConfig", world_size: int) -> MemoryPlan:
    """The MemoryPlan of `cfg` on `world_size` ranks. The longest row is bounded by the
    producers' max_model_len (prompt + response); a longer row than the budget is alone."""
    c = cfg.consumer
    return MemoryPlan(
        world_size=world_size, tp=c.parallel.tensor, ep=c.parallel.expert, dtype=c.dtype,
        optimizer=c.optimizer.name, distributed=c.optimizer.distributed,
        tokens=max(c.memory.micro_batch_tokens, cfg.producer.engine.max_model_len),
        logprob_chunk_tokens=c.memory.logprob_chunk_tokens, recompute=c.memory.recompute,
        expert_imbalance=c.memory.expert_imbalance, offload_fraction=c.optimizer.cpu_offload_fraction,
        ranks_per_node=c.memory.ranks_per_node, weight_transfer_bytes=weight_transfer_bytes(cfg))


def weight_transfer_bytes(cfg: "RlstreamConfig") -> float:
    """Rank 0's GPU bytes of the weight transfer: vLLM's packed double buffer on the nccl
    path; nothing on gloo (host memory) or with transport: file. Backend auto is nccl
    here: the check is of a GPU layout (auto picks nccl on GPU)."""
    w = cfg.consumer.weights
    return WEIGHT_TRANSFER_GPU_BYTES if w.transport == "collective" and w.backend != "rlstream_gloo" else 0.0


def check_config(cfg: "RlstreamConfig", environ: Mapping[str, str] | None = None) -> MemoryCheck | None:
    """The memory check of `cfg` (None when consumer.memory.device_memory_gb is unset), on
    torchrun's WORLD_SIZE in `environ` when set, else consumer.parallel.world_size (load_config
    already refused the two when they differ)."""
    device = cfg.consumer.memory.device_memory_gb
    if device is None:
        return None
    launched = (environ or {}).get("WORLD_SIZE", "")
    world = int(launched) if launched.isdigit() and int(launched) > 0 else cfg.consumer.parallel.world_size
    if world is None:
        return MemoryCheck(device, skipped="consumer.parallel.world_size is not set (nor WORLD_SIZE)")
    config_json = Path(cfg.model.path) / "config.json"
    if not config_json.is_file():
        return MemoryCheck(device, skipped=f"{config_json} is not readable here (the model's dims "
                                           "come from it; run --dry-run where the model is mounted)")
    from rlstream.consumer.train.model import read_hf_dims  # defers torch: only where the model is

    plan, dims = plan_of(cfg, world), read_hf_dims(cfg.model.path)
    return MemoryCheck(device, plan, estimate(dims, plan), host=host_estimate(dims, plan),
                       host_gb=cfg.consumer.memory.host_memory_gb)
