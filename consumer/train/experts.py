"""The trainer's MoE experts: one grouped GEMM over all local experts, or one GEMM each.

    kind = resolve("auto", dims, dtype)   # "te_grouped" | "torch_grouped" | "sequential", logged
    spec = experts_spec(kind)             # the `experts` submodule of the MoE layer spec
    state = sequential_names(state, model)  # grouped weights seen under SequentialMLP's names

  te_grouped     Transformer Engine's `TEGroupedMLP`: GroupedLinear, one grouped GEMM per
                 projection. Needs transformer_engine and CUDA. Its weights are
                 `linear_fc{1,2}.weight{j}`, each shaped like SequentialMLP's.
  torch_grouped  `TorchGroupedMLP` below: megatron-core's legacy `GroupedMLP` (its weight
                 layout, initialisation and expert-parallel attributes) with
                 `torch._grouped_mm` as the kernel. Megatron's own forward needs the
                 `grouped_gemm` package (CUDA kernels, not installable on CPU) and asserts
                 bf16; torch's grouped matmul runs on CPU and on CUDA, in fp32 and bf16,
                 with one constraint: every row stride a multiple of 16 bytes (hidden size
                 and expert FFN size per TP rank a multiple of 4 in fp32, 8 in bf16).
                 Weights: `weight1` [E, hidden, 2 * ffn] and `weight2` [E, ffn, hidden],
                 stored flat as [hidden, E * 2 * ffn] and [E * ffn, hidden].
  sequential     megatron-core's `SequentialMLP`: one GEMM per local expert; the fallback.

`consumer.memory.experts` (common/config/consumer.py): auto takes te_grouped where Transformer
Engine imports with CUDA, else torch_grouped where a probe of `torch._grouped_mm` on
this device, in this dtype and at these shapes succeeds (forward and backward), else
sequential; grouped refuses to start without a grouped kernel; sequential forces it.

Checkpoints, the loader and the weight export stay in SequentialMLP's names
(`...mlp.experts.local_experts.{j}.linear_fc1.weight`): `sequential_names` turns the
grouped parameters into per-expert views of the same storage (no copy), so a copy into
a view loads the grouped weight, and HF export (consumer/train/layout.py) is unchanged.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import re

import torch
import torch.nn.functional as F

from rlstream.common.errors import ConfigError
from rlstream.consumer.telemetry import EXPERTS_KERNEL

log = logging.getLogger(__name__)

SETTINGS = ("auto", "grouped", "sequential")
KINDS = ("te_grouped", "torch_grouped", "sequential")
_KEY = "consumer.memory.experts"


# ---------------------------------------------------------------- choice


def te_available() -> bool:
    """Transformer Engine imports, CUDA is present (its GroupedLinear is CUDA-only), and Megatron
    found TE's grouped linear layers (TE >= 1.7). With an older TE Megatron's spec provider falls
    back to the legacy GroupedMLP, which asserts the `grouped_gemm` package when it is built."""
    if importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available():
        return False
    try:
        from megatron.core.extensions import transformer_engine as te_layers
    except ImportError:
        return False
    return getattr(te_layers, "TEColumnParallelGroupedLinear", None) is not None


def torch_grouped_mm_works(hidden: int, ffn: int, dtype: torch.dtype,
                           device: torch.device | str | None = None) -> str | None:
    """None when `torch._grouped_mm` runs both expert projections (forward and backward)
    at these sizes (`ffn`: one expert's FFN width on this TP rank), else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        with torch.enable_grad():  # a model may be built inside no_grad
            x = torch.randn(2, hidden, dtype=dtype, device=device, requires_grad=True)
            w1 = torch.randn(1, hidden, 2 * ffn, dtype=dtype, device=device, requires_grad=True)
            w2 = torch.randn(1, ffn, hidden, dtype=dtype, device=device, requires_grad=True)
            offs = torch.tensor([2], dtype=torch.int32, device=device)
            h = torch._grouped_mm(x, w1, offs=offs)[:, :ffn].contiguous()
            torch._grouped_mm(h, w2, offs=offs).square().sum().backward()
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm refused {dtype} at hidden={hidden}, ffn={ffn}: {e}"
    return None


def resolve(setting: str, hidden: int, ffn: int, dtype: torch.dtype) -> str:
    """`consumer.memory.experts` made concrete (one of KINDS), logged once per call."""
    if setting not in SETTINGS:
        raise ConfigError(f"unknown experts {setting!r}; use auto, grouped or sequential", _KEY)
    if setting == "sequential":
        kind, why = "sequential", "requested"
    elif te_available():
        kind, why = "te_grouped", "Transformer Engine with CUDA"
    else:
        refused = torch_grouped_mm_works(hidden, ffn, dtype)
        kind, why = ("torch_grouped", "torch._grouped_mm probe passed") if refused is None\
            else ("sequential", refused)
        if kind == "sequential" and setting == "grouped":
            raise ConfigError(f"grouped: no grouped GEMM here (no Transformer "
                              f"Engine; {refused}); use auto or sequential", _KEY)
    log.info("MoE experts: %s (%s=%s: %s)", kind, _KEY, setting, why)
    _report(kind)
    return kind


def _report(kind: str) -> None:
    """The choice as a metric (docs/metrics.md): 1 for `kind`, 0 for the others."""
    for k in KINDS:
        EXPERTS_KERNEL.labels(kind=k).set(1.0 if k == kind else 0.0)


def experts_spec(kind: str):
    """The ModuleSpec of the MoE layer's `experts` for a resolved kind."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if kind == "te_grouped":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        module, submodules = TESpecProvider().grouped_mlp_modules(True, False)
        return ModuleSpec(module=module, submodules=submodules)
    if kind == "torch_grouped":
        return ModuleSpec(module=TorchGroupedMLP)
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    return ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


# ---------------------------------------------------------------- torch grouped module


@contextlib.contextmanager
def _grouped_gemm_check_skipped():
    """GroupedMLP.__init__ asserts the `grouped_gemm` package, which only its forward
    (replaced below) uses."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    check = gg.assert_grouped_gemm_is_available
    gg.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        gg.assert_grouped_gemm_is_available = check


def _grouped_mlp_class():
    from megatron.core.transformer.moe.experts import GroupedMLP

    return GroupedMLP


class TorchGroupedMLP(_grouped_mlp_class()):
    """megatron-core's GroupedMLP with `torch._grouped_mm` as the kernel, any float dtype."""

    def __init__(self, num_local_experts, config, pg_collection=None):
        with _grouped_gemm_check_skipped():
            super().__init__(num_local_experts, config, pg_collection)
        if self.activation_recompute or config.moe_apply_probs_on_input or not config.gated_linear_unit:
            raise ConfigError("torch_grouped experts support SwiGLU experts without moe_act "
                              "recompute or probs on input (rlstream's Qwen3-MoE config)", _KEY)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor):
        """[T, hidden] rows sorted by local expert -> [T, hidden]; as SequentialMLP: the
        SwiGLU output is scaled by the routing prob, then cast back to the input dtype.
        T = 0 (no row for this rank's experts) needs no special case: torch's grouped
        matmul gives every expert weight its zero gradient (tested)."""
        w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)
        # group ends, on the rows' device (the allgather dispatcher counts on the host)
        offs = tokens_per_expert.to(hidden.device).cumsum(0).to(torch.int32)
        gate, up = torch.chunk(_grouped_mm(hidden, w1, offs), 2, dim=-1)
        act = (F.silu(gate) * up * probs.unsqueeze(-1)).to(hidden.dtype)
        return _grouped_mm(act.contiguous(), w2, offs), None


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a freshly laid out gradient: torch._grouped_mm's
    backward refuses a broadcast one (stride 0, e.g. from `out.sum()`), contiguous or not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(memory_format=torch.contiguous_format)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x in groups ending at `offs`, group g times w[g]."""
    return _DenseGrad.apply(torch._grouped_mm(x, w, offs=offs))


# ---------------------------------------------------------------- names

_TE_RE = re.compile(r"^(.*\.mlp\.experts\.)linear_fc([12])\.weight(\d+)$")
_GROUPED_RE = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")


def sequential_names(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict) with grouped expert weights renamed and viewed as
    SequentialMLP's per-expert `local_experts.{j}.linear_fc{1,2}.weight` ([2 * ffn, hidden]
    and [hidden, ffn]); views share storage with the parameters. Other names pass through."""
    experts = {f"{name}.": m.num_local_experts for name, m in model.named_modules()
               if isinstance(m, TorchGroupedMLP)}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if m := _TE_RE.match(name):
            out[f"{m[1]}local_experts.{m[3]}.linear_fc{m[2]}.weight"] = t
        elif (m := _GROUPED_RE.match(name)) and m[1] in experts:
            n, fc = experts[m[1]], m[2]
            hidden = t.shape[0] if fc == "1" else t.shape[1]
            per = t.view(n, hidden, -1) if fc == "1" else t.view(n, -1, hidden)
            for j in range(n):
                out[f"{m[1]}local_experts.{j}.linear_fc{fc}.weight"] = per[j].t()
        else:
            out[name] = t
    return out
