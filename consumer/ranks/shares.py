"""A data-parallel rank's share of a global batch as a few flat tensors.

Rank 0 cuts each step's batch into one `BatchShare` per data-parallel rank
(consumer/train/batch.py `split_global_batch`) and sends each rank only its own
(consumer/ranks/protocol.py); this module turns a share into tensors and back. No
pickle: only numbers cross the wire, and a rank receives about the bytes of
its own samples (`rank_ingress_share`, docs/trainer-scale.md).

    packed = pack(share)           # PackedShare: four flat tensors
    share = unpack(packed.tensors) # on the receiving rank: the same BatchShare

The four tensors:

    header   int64   [MAGIC, minibatches, dp, dp rank, num_responses, num_tokens,
                      routing code, layers, top_k, rewards] then per mini-batch [samples,
                      num_responses, num_tokens, rows, slice_positions (dp x rows)]
                      then per sample [P, T, routing rows (-1: none), has loss mask, staleness]
    tokens   int32   prompt then response ids of each sample, then its loss mask
                     (T values 0/1) if it has one (multi-turn), concatenated
    floats   float32 advantages, sample weights, rewards and sampling temperatures
                     of this share's samples, then the global batch's rewards, then
                     each sample's log-probs
    routing  uint8: the raw bytes of each sample's [rows, layers, top_k] routing
             in the records' type (uint8 up to 256 experts, else uint16),
             concatenated; empty without routing

Every number travels in the type the trainer uses (float32 advantages and
log-probs, the records' integer routing), so a rank trains on exactly the
values `build_global_batch` would give it: the multi-rank equality test holds.
Group ids stay on rank 0 (the advantages are computed there).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlstream.common.errors import RankProtocolError
from rlstream.consumer.train.batch import BatchShare, MiniBatchShare, TrainSample

MAGIC = 0x524C5333  # "RLS3": a header from another rlstream version is refused
ROUTING_TYPES = (None, np.uint8, np.uint16, np.int32, np.int64)
"""Routing element types by wire code (append only); int64 for samples that disagree."""
_FIXED = 10  # header fields before the first mini-batch


@dataclass
class PackedShare:
    """A share as tensors, and how many bytes its samples hold (the ingress yardstick)."""

    header: torch.Tensor
    tokens: torch.Tensor
    floats: torch.Tensor
    routing: torch.Tensor

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.header, self.tokens, self.floats, self.routing]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def sample_bytes(share: BatchShare) -> int:
    """Bytes of this share's samples as the records hold them (prompt and response
    ids, log-probs, routing, a multi-turn loss mask) plus an advantage and a weight each: what a rank
    must receive at the least."""
    n = 0
    for m in share.minibatches:
        for s in m.samples:
            n += s.prompt_ids.nbytes + s.response_ids.nbytes + s.logprobs.nbytes + 8
            n += 0 if s.routed_experts is None else s.routed_experts.nbytes
            n += 0 if s.loss_mask is None else len(s.loss_mask)  # uint8 on the wire
    return n


def _routing_type(samples: list[TrainSample]) -> tuple[int, tuple[int, int]]:
    """(wire code of the routing type, (layers, top_k)); code 0: no sample has routing.
    The records' own type when the samples agree on one (uint8 / uint16), else int64."""
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not routed:
        return 0, (0, 0)
    types = {np.dtype(r.dtype) for r in routed}
    known = [np.dtype(t) for t in ROUTING_TYPES[1:]]
    code = 1 + known.index(types.pop()) if len(types) == 1 and types <= set(known) else len(known)
    return code, routed[0].shape[1:]


def pack(share: BatchShare) -> PackedShare:
    samples = [s for m in share.minibatches for s in m.samples]
    code, (layers, k) = _routing_type(samples)
    dp = share.minibatches[0].slice_positions.shape[0]
    header = [MAGIC, len(share.minibatches), dp, share.dp_rank, share.num_responses, share.num_tokens,
              code, layers, k, len(share.rewards)]
    for m in share.minibatches:
        header += [len(m.samples), m.num_responses, m.num_tokens, m.rows,
                   *m.slice_positions.reshape(-1).tolist()]
    for s in samples:
        header += [len(s.prompt_ids), len(s.response_ids),
                   -1 if s.routed_experts is None else s.routed_experts.shape[0], int(s.loss_mask is not None),
                   s.staleness]
    floats = [m.advantages for m in share.minibatches] + [
        np.array([s.sample_weight for s in samples]), np.array([s.reward for s in samples]),
        np.array([s.temperature for s in samples]), share.rewards] + [s.logprobs for s in samples]
    tokens = [a for s in samples
              for a in (s.prompt_ids, s.response_ids) + (() if s.loss_mask is None else (s.loss_mask,))]
    routing = [s.routed_experts.reshape(-1) for s in samples if s.routed_experts is not None]
    return PackedShare(torch.tensor(header, dtype=torch.int64), _flat(tokens, np.int32),
                       _flat(floats, np.float32),
                       # raw bytes in the records' type: gloo has no uint16
                       _flat(routing, ROUTING_TYPES[code] or np.uint8, as_bytes=True))


def _flat(parts: list[np.ndarray], dtype, as_bytes: bool = False) -> torch.Tensor:
    a = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return torch.from_numpy(a.view(np.uint8) if as_bytes else a)


class _Cursor:
    """Reads consecutive runs of a flat array."""

    def __init__(self, a: np.ndarray):
        self.a, self.at = a, 0

    def take(self, n: int) -> np.ndarray:
        out = self.a[self.at:self.at + n]
        if len(out) != n:
            raise RankProtocolError(f"share truncated: wanted {n} values at {self.at}, "
                                    f"{len(self.a)} in all (the ranks run different rlstream versions?)")
        self.at += n
        return out


def unpack(tensors: list[torch.Tensor]) -> BatchShare:
    """Inverse of `pack` (views into the received tensors, no copy)."""
    header, tokens, floats, routing = (_Cursor(t.numpy()) for t in tensors)
    magic, n_mb, dp, dp_rank, num_responses, num_tokens, code, layers, k, n_rewards = header.take(_FIXED).tolist()
    if magic != MAGIC or not 0 <= code < len(ROUTING_TYPES):
        raise RankProtocolError(f"not a batch share (magic {magic:#x}, routing code {code}): "
                                "restart every rank from one install")
    if code:
        routing = _Cursor(routing.a.view(ROUTING_TYPES[code]))
    heads = []
    for _ in range(n_mb):
        n, responses, mb_tokens, rows = header.take(4).tolist()
        heads.append((n, responses, mb_tokens, header.take(dp * rows).reshape(dp, rows)))
    n_all = sum(h[0] for h in heads)
    adv = [floats.take(h[0]) for h in heads]
    weights, rewards, temps = floats.take(n_all), floats.take(n_all), floats.take(n_all)
    batch_rewards = floats.take(n_rewards)
    samples = []
    for i in range(n_all):
        p, t, r_rows, masked, staleness = header.take(5).tolist()
        ids = tokens.take(p + t)
        mask = tokens.take(t).astype(bool) if masked else None
        r = None if r_rows < 0 else routing.take(r_rows * layers * k).reshape(r_rows, layers, k)
        samples.append(TrainSample(prompt_ids=ids[:p], response_ids=ids[p:], logprobs=floats.take(t),
                                   reward=float(rewards[i]), group_id="", routed_experts=r,
                                   sample_weight=float(weights[i]), temperature=float(temps[i]),
                                   loss_mask=mask, staleness=staleness, from_record=True))
    minibatches, at = [], 0
    for (n, responses, mb_tokens, positions), a in zip(heads, adv):
        minibatches.append(MiniBatchShare(samples[at:at + n], a, responses, mb_tokens, positions))
        at += n
    return BatchShare(minibatches, num_responses, num_tokens, batch_rewards, dp_rank)
