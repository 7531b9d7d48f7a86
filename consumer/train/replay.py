"""Routing Replay (docs/algorithm.md) on megatron-core's `RouterReplay`.

Modes:
  none  the trainer's routers choose their own top-k in every forward.
  R2    the old-policy forward of a global batch RECORDs pi_old's top-k per
        (micro-)batch; every update forward of that batch REPLAYs it.
  R3    every training forward (old-policy and updates) REPLAYs the rollout's
        routing carried in the record. Input positions the record does not
        cover (response-only scope: the prompt) take the trainer's own top-k
        from an extra recording forward; padding takes experts 0..K-1.

Under replay only the choice is fixed: Megatron gathers the training router's
logits at the replayed experts and softmaxes them, so the router still gets
gradients.

Recompute. With activation recompute (`consumer.memory.recompute`) backward re-runs
each layer's forward, routers included: replay stays active through backward
(`replaying` yields the backward call, which switches the routers to
REPLAY_BACKWARD), or the recomputed forward would re-route with the routers' own
top-k and silently give other gradients (tests/integration/test_trainer_memory.py).

Memory. The routing of a batch stays on the host in the record's integer type
(uint8); `replaying` moves one micro-batch to the device. R2's recorded routing
is kept on the host in the same type (pinned on CUDA) between the old-policy
pass and the updates; the trainer's own top-k of the old-policy pass lives only
until `agreement_sums` has compared it, on the device, with the rollout's.

Layout. Batch routing is [B, S, L, K] (consumer/train/batch.py); Megatron's
router sees tokens sequence-major ([S, B] flattened), so each layer's replay
tensor is `routing[:, :, l].transpose(0, 1).reshape(S * B, K)`. Under tensor
parallelism (sequence parallel, see consumer/train/model.py) each TP rank's routers
see only its S/tp slice of the right-padded sequence: replay tensors are cut
to that slice, and recorded ones are all-gathered over the TP group and cut
back to S, so callers always deal in whole [B, S, L, K] batches.

Every model built by consumer/train/model.py has `moe_enable_routing_replay=True`;
this module addresses that model's own routers (not Megatron's process-global
list), so several models can share a process.
"""
from __future__ import annotations

import contextlib
import logging
from enum import Enum
from typing import Callable

import torch

from rlstream.common.errors import ConfigError, InvalidSampleError, ModelError
from rlstream.consumer.train.parallel import gather_sequence, padded_length, sequence_shard

log = logging.getLogger("rlstream.consumer")


class ReplayMode(str, Enum):
    NONE = "none"
    R2 = "R2"
    R3 = "R3"

    @classmethod
    def parse(cls, value: "str | ReplayMode") -> "ReplayMode":
        for m in cls:
            if str(value).lower() in (m.value.lower(), m.name.lower()):
                return m
        raise ConfigError(f"unknown routing replay mode {value!r}; use none, R2 or R3",
                          "consumer.replay")


# ---------------------------------------------------------------- layout helpers


def routers(model) -> list:
    """The model's TopKRouter modules in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if any(r.router_replay is None for r in found):
        raise ModelError("the model was built without moe_enable_routing_replay "
                         "(build it with consumer.model.build_model)")
    return found


def pad_routing(routing: torch.Tensor, seq: int) -> torch.Tensor:
    """Right-pad [B, S, L, K] to `seq` positions; padding takes experts 0..K-1."""
    b, s, n_layers, k = routing.shape
    if seq == s:
        return routing
    fill = torch.arange(k, dtype=routing.dtype, device=routing.device)
    return torch.cat([routing, fill.expand(b, seq - s, n_layers, k)], 1)


def to_layer_indices(routing: torch.Tensor, shard: tuple[int, int] = (0, 1)) -> list[torch.Tensor]:
    """[B, S, L, K] -> L tensors [S/size*B, K]: sequence-parallel rank `rank` of
    `size` (shard), in Megatron's sequence-major token order. S % size == 0."""
    rank, size = shard
    b, s, n_layers, k = routing.shape
    chunk = s // size
    r = routing.transpose(0, 1)[rank * chunk:(rank + 1) * chunk].long()  # [S/size, B, L, K]
    return [r[:, :, layer].reshape(chunk * b, k) for layer in range(n_layers)]


def from_layer_indices(layers: list[torch.Tensor], batch: int,
                       seq: int | None = None) -> torch.Tensor:
    """Inverse of `to_layer_indices` for a whole sequence: L x [S*B, K] ->
    [B, S, L, K], cut to the first `seq` positions if given."""
    stacked = torch.stack([t.reshape(-1, batch, t.shape[-1]) for t in layers], 2)
    return stacked.transpose(0, 1)[:, :seq].contiguous()


def host_routing(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[B, S, L, K] indices as kept on the host between passes: uint8 for <= 256
    experts (int32 beyond), pinned when CUDA is present (asynchronous copies)."""
    dtype = torch.uint8 if num_experts <= 256 else torch.int32
    out = routing.to("cpu", dtype)
    return out.pin_memory() if torch.cuda.is_available() else out


def agreement_sums(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor,
                   chunk: int = 4096) -> torch.Tensor:
    """Per layer, the sum over masked positions of |experts(rollout) & experts(trainer)| / K,
    a float64 [L] tensor on the trainer routing's device. rollout (any integer type,
    any device), trainer [B, S, L, K]; mask bool [B, S]. Only masked positions are
    compared, `chunk` at a time (no [B, S, L, K, K] tensor)."""
    device, k = trainer.device, trainer.shape[-1]
    keep = mask.to(device)
    a, b = rollout.to(device)[keep].long(), trainer[keep]  # [N, L, K]
    total = torch.zeros(trainer.shape[2], dtype=torch.float64, device=device)
    for i in range(0, a.shape[0], chunk):
        hits = (a[i:i + chunk].unsqueeze(-1) == b[i:i + chunk].unsqueeze(-2)).any(-1)
        total += hits.sum((0, 2)).double()
    return total / k


# ---------------------------------------------------------------- Megatron actions


@contextlib.contextmanager
def recording(model):
    """RECORD the routers' own top-k; yields a dict whose "layers" holds, once
    the block exits, L tensors [S*B, K] of the whole (padded) sequence
    (`from_layer_indices` turns them into a batch)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs, out = routers(model), {}
    for r in rs:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        out["layers"] = gather_sequence(
            model, [r.router_replay.get_recorded_indices() for r in rs])
    finally:
        for r in rs:
            r.router_replay.clear_router_replay_action()
            r.router_replay.clear_indices()


@contextlib.contextmanager
def replaying(model, routing: torch.Tensor):
    """REPLAY_FORWARD `routing` [B, S, L, K] (host or device, any integer type) in
    every MoE layer inside the block; yields `backward(loss)`, which keeps the
    replay for backward's recomputed forwards (REPLAY_BACKWARD) and runs it."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(model)
    device = next(model.parameters()).device
    routing = routing.to(device, non_blocking=True)
    routing = pad_routing(routing, padded_length(routing.shape[1], model))
    layers = to_layer_indices(routing, sequence_shard(model))
    if len(layers) != len(rs):
        raise InvalidSampleError(f"routing has {len(layers)} layers, model has {len(rs)} MoE "
                                 "layers; was the rollout produced by this model?")
    for r, idx in zip(rs, layers):
        r.router_replay.set_target_indices(idx)
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def backward(loss: torch.Tensor) -> None:
        for r in rs:  # a recomputed forward pops its layer's indices (replay_backward_list)
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        loss.backward()

    try:
        yield backward
    finally:
        for r in rs:
            r.router_replay.clear_router_replay_action()
            r.router_replay.clear_indices()


def plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


@contextlib.contextmanager
def natural_topk(model):
    """Capture each router's own top-k (argmax of its logits), even while a
    replay is active. Yields a dict whose "layers" holds, once the block exits,
    L tensors [S*B, K] (as `recording`)."""
    rs, captured, out = routers(model), [], {}

    def wrap(router):
        original = router.gating

        def gating(x):
            logits = original(x)
            captured.append(torch.topk(logits.detach().reshape(-1, logits.shape[-1]),
                                       router.topk, dim=-1).indices)
            return logits
        return gating

    for r in rs:
        r.gating = wrap(r)
    try:
        yield out
        out["layers"] = gather_sequence(model, captured)
    finally:
        for r in rs:
            del r.gating  # back to the class method


# ---------------------------------------------------------------- per-step policy


class RoutingReplay:
    """Applies one mode across a training step: `old_policy(key, batch, fwd)` for the
    old-policy forward of a (micro-)batch, `update(key, batch)` around its updates.
    `fwd()` runs the model forward and returns anything; `key` names the batch
    (the trainer uses (mini-batch, micro-batch))."""

    def __init__(self, model, mode: "str | ReplayMode"):
        self.model, self.mode = model, ReplayMode.parse(mode)
        self._saved: dict = {}
        self._warned_unrouted = False

    def start_step(self) -> None:
        self._saved.clear()

    def old_policy(self, key, mb, fwd: Callable):
        """Returns (fwd's result, trainer's own top-k [B, S, L, K] on the device)."""
        b, s = mb.tokens.shape[0], mb.tokens.shape[1] - 1
        if self.mode is ReplayMode.R3:
            self._saved[key] = self._r3_routing(mb, fwd)
            with replaying(self.model, self._saved[key]), natural_topk(self.model) as nat:
                out = fwd()
            return out, from_layer_indices(nat["layers"], b, s)
        with recording(self.model) as rec:
            out = fwd()
        own = from_layer_indices(rec["layers"], b, s)
        if self.mode is ReplayMode.R2:
            self._saved[key] = host_routing(own, self.model.hf_dims.num_experts)
        return out, own

    @contextlib.contextmanager
    def update(self, key, mb):
        """Around an update's forward and backward of batch `key`; yields
        `backward(loss)` (replay kept through backward, see the module docstring)."""
        if self.mode is ReplayMode.NONE:
            yield plain_backward
            return
        with replaying(self.model, self._saved[key]) as backward:
            yield backward

    def _r3_routing(self, mb, fwd: Callable) -> torch.Tensor:
        if mb.routing is None and not self._warned_unrouted:
            # a producer without routing (capture off, or a TP=2 engine on CPU) in the fleet: not a
            # reason to stop training; its positions replay the trainer's own routing (R2's)
            self._warned_unrouted = True
            log.warning("R3: a mini-batch has no routed_experts (a producer runs with routing off); "
                        "its positions use the trainer's own routing")
        missing = mb.input_mask if mb.routing is None else mb.input_mask & ~mb.routing_mask
        if not missing.any():
            return mb.routing
        with torch.no_grad(), recording(self.model) as rec:
            fwd()
        own = host_routing(from_layer_indices(rec["layers"], *mb.input_mask.shape),
                           self.model.hf_dims.num_experts)
        return own if mb.routing is None else torch.where(missing[..., None, None], own, mb.routing)
