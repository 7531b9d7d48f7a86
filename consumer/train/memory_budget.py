"""Will the trainer's layout fit the GPU, and node 0's host memory? The arithmetic of
docs/trainer-scale.md ("Static memory per GPU", "Activations per micro-batch"), as code.

    est = estimate(dims, MemoryPlan(world_size=32, tp=1, ep=8, ...))
    est.total_gb, est.fits(80.0)                    # 59.4, True for Qwen3-30B-A3B
    host = host_estimate(dims, plan)                 # node 0's host GB, the offload's step cost

consumer/train/memory_check.py applies it to a config (`check_config`: --dry-run, start).

Parameters (an HF Qwen3-MoE config.json, consumer/train/model.py `HFModelDims`):
dense D = embeddings (x2 untied) + per layer attention, norms, router + final norm;
experts X = L * E * 3 H F (SwiGLU gate, up, down).

Static bytes per GPU: a bf16 parameter 2 + its fp32 gradient buffer 4 + fp32
master, m, v 12 (fp32 training: parameter 4 + gradient 4 + m, v 8; sgd: no
moments). The distributed optimizer (adamw only) divides the optimizer part by
the data-parallel size of the parameter's group, dp = world / tp for dense and
expert-dp = dp / ep for experts. Per rank D / tp dense and X / (ep tp) expert
parameters (expert TP = tp, consumer/train/parallel.py):

    static = D/tp (p + g + o/dp) + X/(ep tp) (p + g + o/(dp/ep))

Activations of one micro-batch of T positions (T = the token budget, or the
longest row, which is a micro-batch of its own), in the training dtype's 2 B
(4 B for fp32), divided by tp (sequence parallelism):
- recompute on: the saved layer inputs L H + one recomputed layer's working set;
- recompute off: L layers' working sets;
- the logits of one chunk of C positions: C V (2 + 4 + 4) B (bf16 logits, fp32,
  fp32 gradient), C = the micro-batch when `logprob_chunk_tokens` is 0.
A layer's working set per position (elements): qkv (Nq + 2 Nkv) hd, attention
output Nq hd, K dispatched copies of the hidden state and K expert outputs 2 K H,
SwiGLU gate, up, activation and product 4 K F, two norm outputs, the residual and
the output projection 4 H. For Qwen3-30B-A3B that is 149.5 KB at 2 B, the doc's
"~150 KB/position".

Expert imbalance: the dispatcher is dropless with no auxiliary balancing loss
(consumer/train/model.py), so the busiest expert-parallel rank receives more than its
balanced K copies of each position. `expert_imbalance` f (consumer.memory,
default 1.5) multiplies the expert terms (2 K H + 4 K F) of a layer's working
set: f = 2 adds ~115 KB/position at Qwen3-30B-A3B's shape (4.7 GB at 40,960
positions with recompute). f = 1 is the balanced arithmetic of the doc. These are estimates of the largest terms; what they leave out
(CUDA context, allocator fragmentation, NCCL's own communication buffers) is why a layout
within a few GB of the device's memory is "tight".

Weight transfer (rank 0, the rank checked): with `consumer.weights.transport: collective`
on nccl (backend nccl, or auto: nccl on GPU) rank 0 fills vLLM's packed broadcast double
buffer, 2 x 1 GiB on its GPU (WEIGHT_TRANSFER_GPU_BYTES), once per version for the whole
fan-out group. gloo sends from host memory and `transport: file` writes the store: 0.

Optimizer CPU offload (`consumer.optimizer.cpu_offload_fraction` f, megatron-core's
HybridDeviceOptimizer on the precision-aware distributed-optimizer path): the
offloaded share f of each rank's optimizer shard keeps its fp32 master and Adam
moments on the host, so the GPU holds o (1 - f) / dp of the optimizer part. Per
offloaded parameter the host holds 12 B (fp32 master, m, v) plus a pinned fp32
gradient copy (4 B) and the pinned bf16 staging clone megatron makes at start (2 B,
kept by torch's caching host allocator), the pinned bytes counted twice (that
allocator rounds each block up to a power of two): 24 B. Each step moves the fp32
gradient down and the parameter back up, 8 B over PCIe (the return counted as fp32:
an upper bound), and runs AdamW on the host CPU, reading gradient, master, m, v and
writing master, m, v: 28 B of host memory traffic. Step time = PCIe bytes /
ASSUMED_PCIE_GBPS per GPU + the node's Adam traffic / ASSUMED_HOST_MEMORY_GBPS per
node, serial (no overlap): ASSUMPTIONS, not measurements.

Host memory of node 0 (the worst node: rank 0 and the first expert-parallel group):
- the weight snapshots on rank 0: 2 x the bf16 weights (consumer/weights/snapshot.py
  reuses its slab only once idle, so a version being read and the next coexist);
- the offloaded optimizer state of the node's ranks (above);
- the checkpoint as consumer/checkpoint/files.py takes it: each rank copies only its own
  optimizer shard to host (nothing is gathered: D / (tp dp) + X / (ep tp edp) x 12 B
  per rank, unsharded state without the distributed optimizer), and each (tp, ep)
  pair's writer (expert-DP rank 0: the first ep x tp ranks, those on node 0) copies
  its bf16 parameters for the model file.
Checked against `consumer.memory.host_memory_gb` when set (a pod's limit, or the node).

GB here is 1e9 bytes, as in the doc. Pure arithmetic: no torch import, so
`--dry-run` stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GB = 1e9
WEIGHT_TRANSFER_GPU_BYTES = 2 * (1 << 30)
"""Rank 0's GPU buffers of one weight transfer on the nccl path: vLLM's packed broadcast
double buffer (2 x 1 GiB, vllm/distributed/weight_transfer/packed_tensor.py defaults), filled
from the pinned snapshot. One transfer per version with the fan-out group
(consumer/weights/fanout.py), not one per producer; a joining producer's own link adds
one more while it runs (not counted: it lasts one version)."""
LOGIT_BYTES = 2 + 4 + 4
"""Per logit of a chunk: the bf16 output, its fp32 copy for the log-softmax, the fp32 gradient."""
ADAM_STATE_BYTES = 4 + 4 + 4
"""fp32 master, m and v of one parameter (bf16 training)."""
OFFLOAD_HOST_BYTES = ADAM_STATE_BYTES + 2 * (4 + 2)
"""Host bytes per offloaded parameter: the Adam state, and the pinned fp32 gradient copy and
bf16 staging clone at twice their size (power-of-two rounding of the caching host allocator)."""
OFFLOAD_PCIE_BYTES = 4 + 4
"""Per offloaded parameter per step: the fp32 gradient to the host, the parameter back (as fp32)."""
CPU_ADAM_TRAFFIC_BYTES = 4 * 4 + 3 * 4
"""Host memory traffic of one AdamW update: read gradient, master, m, v; write master, m, v."""
ASSUMED_PCIE_GBPS = 25.0
"""ASSUMPTION: host<->GPU GB/s per GPU per direction under load (PCIe Gen5 x16 peaks near
64; GPUs share switches and root ports). Not measured here."""
ASSUMED_HOST_MEMORY_GBPS = 200.0
"""ASSUMPTION: host memory GB/s one node's CPU AdamW processes reach together. Not measured."""
SNAPSHOT_COPIES = 2
"""Weight snapshots rank 0 may hold at once (the one links still read, and the next)."""


class ModelShape(Protocol):
    """The fields of consumer/train/model.py `HFModelDims` this arithmetic reads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_ffn_hidden_size: int
    num_experts: int
    topk: int
    tie_word_embeddings: bool


def parameter_counts(d: ModelShape) -> tuple[int, int]:
    """(dense D, experts X) parameters of a Qwen3-MoE model."""
    h, q, kv = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    attention = 2 * h * q + 2 * h * kv                  # q and o; k and v
    norms = 2 * h + 2 * d.head_dim                      # input and post-attention; q and k norms
    router = d.num_experts * h
    embeddings = d.vocab_size * h * (1 if d.tie_word_embeddings else 2)
    dense = embeddings + d.num_layers * (attention + norms + router) + h  # + final norm
    experts = d.num_layers * d.num_experts * 3 * h * d.moe_ffn_hidden_size
    return dense, experts


@dataclass(frozen=True)
class MemoryPlan:
    """The settings the estimate depends on (consumer.parallel, .optimizer, .memory, .dtype)."""

    world_size: int
    tp: int = 1
    ep: int = 1
    dtype: str = "bfloat16"
    optimizer: str = "adamw"
    distributed: bool = True
    tokens: int = 16384
    """Positions of the largest micro-batch (the token budget or the longest row)."""
    logprob_chunk_tokens: int = 2048
    recompute: bool = False
    expert_imbalance: float = 1.0
    """Rows the busiest expert-parallel rank receives / the balanced share (1: balanced)."""
    offload_fraction: float = 0.0
    """Share of each rank's optimizer shard (master, moments) held and updated on the host."""
    ranks_per_node: int = 8
    """Trainer ranks on one node (node 0's host memory holds theirs)."""
    weight_transfer_bytes: float = 0.0
    """Rank 0's GPU buffers for sending weights to the producers (WEIGHT_TRANSFER_GPU_BYTES on
    the nccl path; 0 on gloo or with transport: file). Rank 0 is the rank checked."""

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def expert_dp(self) -> int:
        return max(self.dp // self.ep, 1)

    @property
    def node_ranks(self) -> int:
        return min(self.world_size, self.ranks_per_node)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of one trainer rank, by part."""

    dense_bytes: float
    expert_bytes: float
    activation_bytes: float
    transfer_bytes: float = 0.0
    """Weight transfer buffers on rank 0 (MemoryPlan.weight_transfer_bytes)."""

    @property
    def static_bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes

    @property
    def total_gb(self) -> float:
        return (self.static_bytes + self.activation_bytes + self.transfer_bytes) / GB

    def fits(self, device_gb: float) -> bool:
        return self.total_gb <= device_gb

    def summary(self) -> str:
        transfer = f", weight transfer {self.transfer_bytes / GB:.1f} GB (rank 0)" if self.transfer_bytes else ""
        return (f"dense {self.dense_bytes / GB:.1f} + experts {self.expert_bytes / GB:.1f} = static "
                f"{self.static_bytes / GB:.1f} GB, activations {self.activation_bytes / GB:.1f} GB{transfer}, "
                f"total {self.total_gb:.1f} GB per GPU")


def _bytes_per_parameter(plan: MemoryPlan, group_dp: int) -> float:
    """Parameter + gradient buffer + the optimizer state left on the GPU (sharded over
    `group_dp` when distributed; the offloaded share lives on the host)."""
    param, grad, optim = (2 if plan.dtype == "bfloat16" else 4), 4, _optimizer_state_bytes(plan)
    sharded = plan.distributed and plan.optimizer == "adamw"
    return param + grad + (optim / group_dp if sharded else optim) * (1 - plan.offload_fraction)


def _optimizer_state_bytes(plan: MemoryPlan) -> int:
    """Per parameter: the fp32 master (bf16 training) and Adam's m and v (adamw)."""
    return (4 if plan.dtype == "bfloat16" else 0) + (8 if plan.optimizer == "adamw" else 0)


def layer_working_elements(d: ModelShape, expert_imbalance: float = 1.0) -> float:
    """Elements per position one layer holds for its backward (module docstring); the
    expert terms are those of the busiest rank, `expert_imbalance` x the balanced ones."""
    h, k = d.hidden_size, d.topk
    attention = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim + d.num_heads * d.head_dim
    experts = 2 * k * h + 4 * k * d.moe_ffn_hidden_size
    return attention + expert_imbalance * experts + 4 * h


def activation_bytes(d: ModelShape, plan: MemoryPlan) -> float:
    """Activations of one micro-batch of `plan.tokens` positions on one rank."""
    width = 2 if plan.dtype == "bfloat16" else 4
    layer = layer_working_elements(d, plan.expert_imbalance) * width
    per_position = (d.num_layers * d.hidden_size * width + layer if plan.recompute
                    else d.num_layers * layer)
    chunk = plan.logprob_chunk_tokens or plan.tokens
    logits = min(chunk, plan.tokens) * d.vocab_size * LOGIT_BYTES
    return (plan.tokens * per_position + logits) / plan.tp


def estimate(d: ModelShape, plan: MemoryPlan) -> MemoryEstimate:
    """Static and activation bytes per GPU of `plan` for model `d`."""
    dense, experts = parameter_counts(d)
    return MemoryEstimate(
        dense_bytes=dense / plan.tp * _bytes_per_parameter(plan, plan.dp),
        expert_bytes=experts / (plan.ep * plan.tp) * _bytes_per_parameter(plan, plan.expert_dp),
        activation_bytes=activation_bytes(d, plan), transfer_bytes=plan.weight_transfer_bytes)


# ---------------------------------------------------------------- host memory and offload


@dataclass(frozen=True)
class HostEstimate:
    """Node 0's host bytes by part, and the offload's step-time cost (module docstring)."""

    snapshot_bytes: float
    offload_bytes: float
    checkpoint_bytes: float
    offloaded_parameters: float
    """Parameters one rank updates on the host."""
    pcie_seconds: float
    cpu_adam_seconds: float

    @property
    def total_gb(self) -> float:
        return (self.snapshot_bytes + self.offload_bytes + self.checkpoint_bytes) / GB

    @property
    def step_seconds(self) -> float:
        """What the offload adds to a step, copies and CPU update in series."""
        return self.pcie_seconds + self.cpu_adam_seconds

    def fits(self, host_gb: float | None) -> bool:
        return host_gb is None or self.total_gb <= host_gb

    def summary(self) -> str:
        offload = (f"offload {self.offloaded_parameters / 1e9:.2f}e9 params per rank: +{self.step_seconds:.1f} s "
                   f"per step (PCIe {self.pcie_seconds:.1f} s at an assumed {ASSUMED_PCIE_GBPS:g} GB/s per GPU, "
                   f"CPU AdamW {self.cpu_adam_seconds:.1f} s at an assumed {ASSUMED_HOST_MEMORY_GBPS:g} GB/s per node)"
                   if self.offloaded_parameters else "no optimizer offload")
        return (f"snapshots {self.snapshot_bytes / GB:.0f} + offloaded optimizer {self.offload_bytes / GB:.0f} + "
                f"checkpoint copies {self.checkpoint_bytes / GB:.0f} = {self.total_gb:.0f} GB on node 0; {offload}")


def offloaded_parameters(d: ModelShape, plan: MemoryPlan) -> float:
    """Parameters of one rank's optimizer shard that live on the host (dense shard over
    dp, expert shard over expert-dp; the offload needs the distributed optimizer)."""
    dense, experts = parameter_counts(d)
    shard = dense / plan.tp / plan.dp + experts / (plan.ep * plan.tp) / plan.expert_dp
    return plan.offload_fraction * shard


def checkpoint_host_bytes(d: ModelShape, plan: MemoryPlan) -> float:
    """Node 0's host bytes of one checkpoint in the per-rank form (module docstring)."""
    dense, experts = parameter_counts(d)
    sharded = plan.distributed and plan.optimizer == "adamw"
    dense_dp, expert_dp = (plan.dp, plan.expert_dp) if sharded else (1, 1)
    own_shard = (dense / plan.tp / dense_dp + experts / (plan.ep * plan.tp) / expert_dp) * _optimizer_state_bytes(plan)
    model_writers = min(plan.ep * plan.tp, plan.node_ranks)  # expert-DP rank 0 of each (tp, ep) pair
    weights = model_writers * (dense / plan.tp + experts / (plan.ep * plan.tp)) * 2
    return plan.node_ranks * own_shard + weights


def host_estimate(d: ModelShape, plan: MemoryPlan) -> HostEstimate:
    """Node 0's host memory of `plan`, and what its optimizer offload adds to a step."""
    dense, experts = parameter_counts(d)
    per_rank = offloaded_parameters(d, plan)
    return HostEstimate(
        snapshot_bytes=SNAPSHOT_COPIES * (dense + experts) * 2,
        offload_bytes=plan.node_ranks * per_rank * OFFLOAD_HOST_BYTES,
        checkpoint_bytes=checkpoint_host_bytes(d, plan),
        offloaded_parameters=per_rank,
        pcie_seconds=per_rank * OFFLOAD_PCIE_BYTES / (ASSUMED_PCIE_GBPS * GB),
        cpu_adam_seconds=plan.node_ranks * per_rank * CPU_ADAM_TRAFFIC_BYTES / (ASSUMED_HOST_MEMORY_GBPS * GB))

