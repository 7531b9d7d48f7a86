"""The `consumer` section: batch shape, loss, optimizer, parallel layout, memory
cuts, checkpoint cadence, weight sync and the experiments' stress knobs."""
from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from rlstream.common.config.base import _Section, yaml_on_off
from rlstream.common.config.shared import ConsumerLivenessSettings, HttpSettings
from rlstream.common.errors import ConfigError

LossName = Literal["minirl", "minirl_no_is", "minirl_length_norm", "grpo", "cispo", "dppo_tv", "dppo_kl"]
"""The registered losses (consumer/train/losses.py registers each once; a unit test
checks that this list equals the registry, so the config package needs no torch)."""

DYNAMIC_SAMPLING_LOSSES: tuple[str, ...] = get_args(LossName)
"""Losses `consumer.dynamic_sampling: auto` filters zero-variance groups for: every
registered one. Each builds a group-relative advantage (mean or mean/std over the
group), which is exactly 0 for every sample of a group whose rewards are equal;
and the ablations keep the same sampling as MiniRL so that they differ from it only
in what they ablate (the objectives experiment compares them). A loss with a
baseline that is not the group's would be left out (a unit test checks the rule)."""


class LossSettings(_Section):
    """The policy-gradient objective (docs/algorithm.md, consumer/train/losses.py)."""

    name: LossName = "minirl"
    """minirl (the paper's), its ablations minirl_no_is / minirl_length_norm, grpo, cispo, and
    DPPO's dppo_tv (Binary-TV) / dppo_kl (Binary-KL) trust regions on the rollout policy."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Mask (MiniRL) or clip (GRPO, CISPO) below 1 - eps_low; < 1 so the bound stays positive."""
    eps_high: float = Field(0.27, ge=0)
    """Mask (MiniRL) or clip (GRPO, CISPO) above 1 + eps_high."""
    is_cap: float = Field(5.0, gt=0)
    """C: truncation of the token IS weight pi/mu_old."""
    advantage: Literal["auto", "mean", "mean_std"] = "auto"
    """auto: what the loss registered (mean-centred for MiniRL/CISPO/DPPO, mean/std for GRPO)."""
    delta_low: float | None = Field(None, gt=0)
    """DPPO: mask a token with A <= 0 whose probability fell more than this below the rollout
    policy's (dppo_tv: mu - pi; dppo_kl: the Bernoulli KL). None: the variant's default
    (dppo_tv 0.15, dppo_kl 0.05: verl's Qwen3-30B-A3B recipe)."""
    delta_high: float | None = Field(None, gt=0)
    """DPPO: mask a token with A > 0 whose probability rose more than this above the rollout
    policy's (dppo_tv: pi - mu; dppo_kl: the Bernoulli KL). None: the variant's default."""


class OptimizerSettings(_Section):
    """The optimizer of the trainer (consumer/train/optimizer.py)."""

    name: Literal["adamw", "sgd"] = "adamw"
    """adamw (decoupled weight decay) or plain sgd (betas, eps and weight_decay unused)."""
    lr: float = Field(1e-4, gt=0)
    """Learning rate (configs/tiny-cpu.yaml measured 2e-4 for the tiny model)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW only)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon."""
    grad_clip: float = Field(1.0, ge=0)
    """Largest global gradient norm (over every shard); 0 turns clipping off."""
    distributed: bool = True
    """Shard the fp32 master weights and Adam moments over the data-parallel ranks
    (Megatron's DistributedOptimizer: 12 B/param divided by the data-parallel size,
    docs/trainer-scale.md). adamw only: sgd keeps a full copy per rank (Megatron
    shards Adam state only)."""
    cpu_offload_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of this rank's optimizer shard whose fp32 master, Adam moments and update
    live on the host (megatron-core's HybridDeviceOptimizer: `optimizer_cpu_offload`,
    `optimizer_offload_fraction`); 0: off. Each step copies the offloaded shard's fp32
    gradients to the host and its bf16 parameters back, and AdamW runs on the CPU: it
    frees GPU memory (12 B per offloaded parameter) for host memory and step time, both
    in the memory check (consumer/train/memory_budget.py). adamw with `distributed` only (the
    offload reuses Megatron's precision-aware distributed-optimizer path); GPU only:
    megatron-core's offload needs CUDA streams."""
    cpu_offload_overlap: bool = False
    """Overlap the offloaded part's gradient copies with the CPU update, one CPU optimizer
    per parameter (megatron-core's `overlap_cpu_optimizer_d2h_h2d`). Off: one CPU AdamW
    after all copies, the step-time estimate's assumption."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _offload_needs_the_distributed_adam(self) -> "OptimizerSettings":
        if self.cpu_offload_fraction > 0 and not (self.name == "adamw" and self.distributed):
            raise ValueError(f"cpu_offload_fraction {self.cpu_offload_fraction:g} needs name: adamw with "
                             "distributed: true (megatron-core offloads the distributed optimizer's Adam "
                             "state); set it to 0 or use the distributed adamw")
        return self


class ParallelSettings(_Section):
    """Tensor/expert-parallel layout under torchrun. The data-parallel size is
    world size / tensor; Megatron carves expert-parallel groups out of the
    data-parallel ranks, so `expert` must divide it. The world size is known
    where the launcher sets WORLD_SIZE (torchrun): the loader checks the layout
    then, `--dry-run` included."""

    tensor: int = Field(1, ge=1)
    """Tensor-parallel size (sequence parallel too; it must divide the KV heads,
    the expert FFN width and the vocabulary)."""
    expert: int = Field(1, ge=1)
    """Expert-parallel size (must divide the number of experts and the data-parallel size)."""
    world_size: int | None = Field(None, ge=1, le=65536)
    """The number of trainer processes this file is written for (nodes x GPUs per node);
    None: not declared. When set, the layout must fit it (checked without a launcher, e.g.
    `--dry-run` on a laptop), torchrun's WORLD_SIZE must equal it, and the memory check
    (consumer/train/memory_budget.py) uses it."""

    @field_validator("tensor")
    @classmethod
    def _tensor_fits(cls, v: int, info: ValidationInfo) -> int:
        world = (info.context or {}).get("world_size")
        if world and world % v:
            raise ValueError(f"world size {world} is not a multiple of tensor={v}; launch a "
                             "multiple of it (torchrun --nproc_per_node)")
        return v

    @field_validator("expert")
    @classmethod
    def _expert_fits(cls, v: int, info: ValidationInfo) -> int:
        world, tensor = (info.context or {}).get("world_size"), info.data.get("tensor")
        if world and tensor and world % tensor == 0 and (world // tensor) % v:
            raise ValueError(f"expert={v} must divide the data-parallel size "
                             f"world/tensor = {world}/{tensor} = {world // tensor}")
        return v

    @field_validator("world_size")
    @classmethod
    def _declared_world(cls, v: int | None, info: ValidationInfo) -> int | None:
        launched = (info.context or {}).get("world_size")
        if v is not None and launched and launched != v:
            raise ValueError(f"the file is written for {v} ranks but torchrun's WORLD_SIZE is {launched}: "
                             "launch that many (--nnodes x --nproc_per_node) or change world_size")
        tensor, expert = info.data.get("tensor"), info.data.get("expert")
        if v is not None and tensor and expert and (v % tensor or (v // tensor) % expert):
            raise ValueError(f"tensor={tensor}, expert={expert} does not fit {v} ranks: world_size must be "
                             "a multiple of tensor, and expert must divide world_size / tensor")
        return v

    def data_parallel(self, world_size: int) -> int:
        """world size / tensor, after checking that the layout fits `world_size`."""
        ctx = {"world_size": world_size}
        try:  # the same checks as at load time, now that the world size is known
            ParallelSettings.model_validate(self.model_dump(), context=ctx)
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(err["msg"].removeprefix("Value error, "),
                              key=f"consumer.parallel.{err['loc'][0]}") from None
        return world_size // self.tensor


class TrainerMemorySettings(_Section):
    """How one forward/backward is cut to bound activation memory (consumer/train/trainer.py,
    consumer/train/logprobs.py, consumer/train/attention.py; docs/trainer-scale.md)."""

    micro_batch_tokens: int = Field(16384, ge=1)
    """Token budget of one forward/backward: each mini-batch (this rank's share) is cut
    into micro-batches of at most this many padded input positions (rows x longest row),
    rows grouped by length; a row longer than the budget is a micro-batch of its own.
    Gradients accumulate over micro-batches, so the update equals the unsplit one."""
    logprob_chunk_tokens: int = Field(2048, ge=0)
    """Positions whose output-layer logits ([positions, vocab] fp32) exist at once in the
    log-prob and entropy (recomputed in backward); 0: the whole micro-batch at once."""
    recompute: bool = False
    """Full activation recompute, one layer at a time: each layer keeps only its input
    and recomputes the rest in backward (about a third more compute)."""
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core attention. te: Transformer Engine's fused attention (needs transformer_engine);
    sdpa: torch scaled_dot_product_attention (flash/memory-efficient kernels, no [S, S]
    scores); local: Megatron's unfused DotProductAttention ([heads, S, S] scores, an
    explicit mask). auto: te when Transformer Engine imports, else sdpa."""
    experts: Literal["auto", "grouped", "sequential"] = "auto"
    """MoE experts kernel (consumer/train/experts.py). grouped: one grouped GEMM over all local
    experts (Transformer Engine's TEGroupedMLP with CUDA, else torch._grouped_mm: CPU or
    CUDA, fp32 or bf16, hidden and per-TP-rank expert FFN sizes whose rows are multiples
    of 16 bytes); refuses to start without one. sequential: one GEMM per expert
    (Megatron's SequentialMLP). auto: grouped where available, else sequential. The
    choice is logged and is the model's `experts`; checkpoints and the weight export
    use the same (per-expert) names either way."""
    device_memory_gb: float | None = Field(None, gt=0, le=4096)
    """Memory of one trainer GPU in GB (1e9 bytes), e.g. 80 for an H100. With
    consumer.parallel.world_size set, `--dry-run` prints the per-GPU estimate of
    docs/trainer-scale.md (static + activations, consumer/train/memory_budget.py) and the
    consumer refuses to start a layout that cannot fit. None: no check."""
    host_memory_gb: float | None = Field(None, gt=0, le=65536)
    """Host memory of one trainer node (or its pod's memory limit) in GB. The check
    prints node 0's host estimate either way (weight snapshots, offloaded optimizer
    state, the per-rank checkpoint copies; consumer/train/memory_budget.py); set, the consumer
    refuses a layout whose estimate exceeds it. None: printed, not checked."""
    ranks_per_node: int = Field(8, ge=1, le=1024)
    """Trainer ranks on one node (torchrun --nproc_per_node): how many ranks' host
    memory node 0 holds."""
    expert_imbalance: float = Field(1.5, ge=1.0, le=64.0)
    """Token rows the busiest expert-parallel rank receives, as a multiple of the balanced
    share (K x its tokens), in the activation estimate. The dispatcher is dropless with no
    auxiliary balancing loss, so one rank's experts can receive well above the average;
    1.5 is a working margin, 1.0 assumes perfect balance (docs/trainer-scale.md)."""


class CheckpointSettings(_Section):
    """When the consumer checkpoints (consumer/checkpoint/cadence.py, docs/consumer.md). After a
    step, a checkpoint is due once `every_steps` steps or `every_seconds` seconds
    passed since the last one (whichever comes first; 0 turns that trigger off), and
    always at a clean stop. The loop blocks only for an in-memory snapshot of the
    trainer state; a background thread writes and commits it. A crash redoes the
    steps since the last checkpoint (exactly-once holds in the final model's lineage)."""

    every_steps: int = Field(10, ge=0)
    """Checkpoint every this many optimizer steps (1: every step; 0: no step trigger)."""
    every_seconds: float = Field(600.0, ge=0)
    """Checkpoint when this many seconds passed since the last one (0: no time trigger)."""

    @model_validator(mode="after")
    def _some_trigger(self) -> "CheckpointSettings":
        if self.every_steps == 0 and self.every_seconds == 0:
            raise ValueError("every_steps and every_seconds are both 0: set one > 0, or a crash "
                             "would redo every step since the start")
        return self


class WeightSyncSettings(_Section):
    """How the trainer moves each new version to the producers (consumer.weights;
    docs/weights.md). The durable store (`consumer.weight_store_dir`) is the
    fallback and the start-up path either way."""

    transport: Literal["collective", "file"] = "collective"
    """collective: stream every version to each producer over a link of its own
    (layer groups, digests), write the durable store every `durable_every` versions.
    file: write the durable store every version and announce it (the old path)."""
    backend: Literal["auto", "rlstream_gloo", "nccl"] = "auto"
    """The weight-transfer engine (vLLM's framework): auto = rlstream_gloo on CPU,
    nccl on GPU. Must match the producers' producer.engine.weight_transfer."""
    host: str = "127.0.0.1"
    """Address the trainer's weight endpoint listens on (rank 0)."""
    advertise_host: str | None = None
    """Address producers dial (announced); None: `host`, or this host's FQDN when `host`
    is a wildcard (0.0.0.0)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 picks a free one (it is announced)."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Per-link bound of every blocking step: a dead or hung producer costs its
    own link this much at most, counted; the others continue."""
    durable_every: int = Field(10, ge=1)
    """Write the durable store in the background every K versions (version % K == 0)
    and at shutdown. Ignored with transport: file (every version)."""

    def advertised_host(self) -> str:
        """The host announced to producers: `advertise_host`, else `host`, else (a wildcard
        listen address is nothing a producer can dial) this machine's FQDN."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            import socket

            return socket.getfqdn()
        return self.host


class StressSettings(_Section):
    """`consumer.stress`: a training-inference mismatch made on purpose, so that an experiment can
    grow it and watch each loss degrade (`rlstream experiment stability`, docs/stability.md)."""

    logprob_temperature_scale: float = Field(1.0, gt=0, le=10)
    """The trainer takes pi_old and pi at this multiple of each record's sampling temperature, so
    they differ from the sampler's mu_old as if the engines disagreed. 1.0: off (the normal case)."""


class ConsumerSettings(_Section):
    """The trainer service (consumer/service.py) and its trainer (consumer/train/trainer.py)."""

    group_size: int = Field(8, ge=1, le=1024)
    """G: samples per group (must match the producers)."""
    groups_per_batch: int = Field(4, ge=1)
    """B: groups per global batch."""
    num_minibatches: int = Field(1, ge=1)
    """N: updates per global batch (1 = on-policy); at most B x G."""
    group_timeout_s: float = Field(120.0, gt=0)
    """An incomplete group older than this is dropped and counted."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many global steps (None: run until stopped)."""
    checkpoint_dir: str = "runs/checkpoints"
    """Checkpoints (model, optimizer, offsets) and the audit log trained.jsonl;
    shared by every rank under torchrun."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept (the newest)."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    weight_store_dir: str = "runs/weights"
    """Versioned HF weight directories the producers load."""
    keep_versions: int = Field(3, ge=1)
    """Weight versions kept; producers must not lag further behind."""
    weights: WeightSyncSettings = WeightSyncSettings()
    """How new versions reach the producers: collective links or the durable store."""
    replay: Literal["none", "R2", "R3"] = "none"
    """Routing replay (consumer/train/replay.py): none, R2 (pi_old's routing) or R3 (the rollout's)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of parameters and compute. bfloat16 keeps fp32 master weights, fp32 Adam
    moments and fp32 gradient reduction (Megatron's mixed-precision optimizer)."""
    loss: LossSettings = LossSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    memory: TrainerMemorySettings = TrainerMemorySettings()
    parallel: ParallelSettings = ParallelSettings()
    http: HttpSettings = HttpSettings()
    liveness: ConsumerLivenessSettings = ConsumerLivenessSettings()
    num_threads: int = Field(1, ge=1)
    """torch/OpenMP threads of each trainer process."""
    run_file: str | None = None
    """JSON status file (pid, HTTP address; final outcome counters at stop) for
    supervisors and tests (common/runfile.py); written by rank 0. None: none."""
    stress: StressSettings = StressSettings()
    """Stress tests for experiments (never for a real run): a controlled training-inference mismatch."""
    dynamic_sampling: Literal["auto", "on", "off"] = "auto"
    """Filter, at the staleness gate, complete groups whose G rewards are all equal
    (their group-relative advantage is 0: no gradient), counted as outcome
    `filtered`; the batch is filled from the stream instead. auto: on for every
    loss in DYNAMIC_SAMPLING_LOSSES (all registered ones) when G >= 2 (docs/consumer.md)."""

    @property
    def filters_zero_variance(self) -> bool:
        """Whether the gate filters zero-variance groups (`dynamic_sampling` resolved)."""
        if self.dynamic_sampling == "auto":
            return self.loss.name in DYNAMIC_SAMPLING_LOSSES and self.group_size >= 2
        return self.dynamic_sampling == "on"

    @field_validator("dynamic_sampling", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        return yaml_on_off(v)

    @field_validator("dynamic_sampling")
    @classmethod
    def _groups_can_vary(cls, v: str, info: ValidationInfo) -> str:
        if v == "on" and info.data.get("group_size") == 1:
            raise ValueError("a group of one sample never has reward variance: the gate would filter "
                             "every group; set off (or auto) with group_size 1")
        return v

    @field_validator("num_minibatches")
    @classmethod
    def _minibatches_fit(cls, v: int, info: ValidationInfo) -> int:
        samples = info.data.get("group_size", 0) * info.data.get("groups_per_batch", 0)
        if samples and v > samples:
            raise ValueError(f"{v} mini-batches cannot be cut from a batch of B x G = {samples} samples")
        return v
