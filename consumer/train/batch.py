"""The trainer's input types: `TrainSample` (numpy, from a rollout record) and
`GlobalBatch` (padded torch tensors split into N mini-batches).

Position convention. A sample's sequence is `prompt + response` (length
P + T); the forward input is its first P + T - 1 tokens and position `s` of
every [.., S] tensor predicts token s + 1. Response token t sits at position
P - 1 + t. So `rollout_logprobs`, `loss_mask` and `routing` are all indexed
by input position, exactly like the trainer's forward and vLLM's routing
rows ("row i = routing of input position i").

Data parallelism: rank 0 computes the advantages and the global counts and
cuts each mini-batch into one slice per data-parallel rank
(`split_global_batch`: a `BatchShare` per rank, unpadded); each rank pads its
own share into its mini-batches (`batch_from_share`), to the shape every rank
uses. `build_global_batch` is the two in one process. `num_responses` /
`num_tokens` of a mini-batch are the global counts (the loss normalisers, see
consumer/train/losses.py); `num_tokens` counts model tokens. Under torchrun a share
travels to its rank as a few flat tensors (consumer/ranks/shares.py), never as the
whole batch.

Multi-turn samples (record schema 2): `loss_mask` is True only on the record's
model tokens, so every loss and statistic over it (loss, KL, entropy, clip and
IS fractions) skips environment tokens; routing stays per input position
(environment positions included) so R3 replays the whole forward.

Micro-batches (`micro_batch_tokens`, consumer.memory): each mini-batch's rows
are grouped longest first into micro-batches of at most that many padded input
positions (rows x the group's longest row; a longer row is a group of its own),
and `MiniBatch.micro_batches()` gives them as MiniBatch views trimmed to their
longest row. The plan is made from every rank's lengths (a share carries every
rank's `slice_positions`), so micro-batch j has the same shape on every
data-parallel rank, as Megatron's expert-parallel dispatch needs. Every loss is
a sum over rows divided by global counts, so the micro-batches' losses add up
to the mini-batch's.

Routing stays in the record's integer type on the host (uint8 for <= 256
experts: [B, S, L, K] is 384 B per position at Qwen3-30B-A3B's 48 x 8); replay
moves one micro-batch at a time to the device (consumer/train/replay.py).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from rlstream.common.errors import ConfigError, InvalidSampleError
from rlstream.common.record import Rollout

ADVANTAGE_MODES = ("mean", "mean_std")


@dataclass
class TrainSample:
    """One rollout as the trainer sees it.

    prompt_ids int32[P]; response_ids int32[T]; logprobs float32[T] (log mu_old
    of each response token); routed_experts optional uint8/uint16
    [P+T-1, L, K] (every input position) or [T, L, K] (input positions
    P-1 .. P+T-2, response-only scope); sample_weight: staleness decay;
    temperature: the sampling temperature of the record (the trainer's
    log-probs are taken at it: consumer/train/model.py); staleness: the record's age
    in versions at the gate (the step signals are split by it).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    reward: float
    group_id: str
    routed_experts: np.ndarray | None = None
    sample_weight: float = 1.0
    temperature: float = 1.0
    loss_mask: np.ndarray | None = None
    """bool[T]: True on model tokens (multi-turn records, schema 2); None: all
    model tokens. Losses, KL, entropy and clip statistics count model tokens only."""
    staleness: int = 0
    from_record: bool = field(default=False, compare=False)
    """Built by `from_rollout`: rlstream.common.record.validate already checked the shapes."""

    @classmethod
    def from_rollout(cls, r: Rollout, weight: float = 1.0, staleness: int = 0,
                     temperature_scale: float = 1.0) -> "TrainSample":
        """A validated rollout record, weighted and aged by the staleness gate.
        `temperature_scale` (a stress test, `consumer.stress`): the trainer takes its
        log-probs at this multiple of the record's sampling temperature."""
        return cls(prompt_ids=r.prompt_ids, response_ids=r.response_ids, logprobs=r.logprobs,
                   reward=r.reward, group_id=r.group_id, routed_experts=r.routed_experts,
                   sample_weight=weight, temperature=r.temperature * temperature_scale,
                   loss_mask=r.loss_mask, staleness=staleness, from_record=True)

    @property
    def num_model_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())

    def validate(self) -> None:
        """The sample weight (the gate's, which no record carries), and for samples
        not built from a record the shapes `rlstream.common.record.validate` guarantees."""
        if not (math.isfinite(self.sample_weight) and self.sample_weight >= 0):
            raise InvalidSampleError(f"sample of group {self.group_id!r}: sample_weight "
                                     f"{self.sample_weight} must be finite and >= 0")
        if not self.from_record:
            self._check_shapes()
            if not (math.isfinite(self.temperature) and self.temperature > 0):
                raise InvalidSampleError(f"sample of group {self.group_id!r}: temperature "
                                         f"{self.temperature} must be finite and > 0")

    def _check_shapes(self) -> None:
        p, t = len(self.prompt_ids), len(self.response_ids)
        if p < 1 or t < 1:
            raise InvalidSampleError(f"sample of group {self.group_id!r}: empty prompt or response")
        if self.logprobs.shape != (t,):
            raise InvalidSampleError(f"sample of group {self.group_id!r}: logprobs shape "
                                     f"{self.logprobs.shape}, expected ({t},)")
        m = self.loss_mask
        if m is not None and (m.dtype != bool or m.shape != (t,)):
            raise InvalidSampleError(f"sample of group {self.group_id!r}: loss_mask {m.dtype} {m.shape}, "
                                     f"expected bool ({t},)")
        r = self.routed_experts
        if r is not None and (r.ndim != 3 or r.shape[0] not in (p + t - 1, t)):
            raise InvalidSampleError(f"sample of group {self.group_id!r}: routed_experts shape "
                                     f"{r.shape}, expected ({p + t - 1} or {t}, layers, top_k)")


@dataclass
class MiniBatch:
    """This rank's share of one mini-batch. B responses, S input positions.

    tokens int64[B, S+1] (input = tokens[:, :-1], targets = tokens[:, 1:]);
    loss_mask bool[B, S]; input_mask bool[B, S] (real, non-padding input
    positions); rollout_logprobs float32[B, S]; advantages float32[B];
    sample_weight float32[B]; routing uint8 (int32 for > 256 experts) [B, S, L, K]
    or None, with routing_mask bool[B, S] (True where the rollout's routing is
    known); temperature float32[B] (padding rows 1.0), or None when every
    sample's temperature is 1.0 (the log-prob functions then skip the division);
    staleness int64[B] (padding rows 0).
    `plan`: this rank's micro-batches, (rows, input positions) each.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    input_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    sample_weight: torch.Tensor
    num_responses: int
    num_tokens: int
    routing: torch.Tensor | None = None
    routing_mask: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    staleness: torch.Tensor | None = None
    plan: list[tuple[tuple[int, ...], int]] = field(default_factory=list)

    def micro_batches(self) -> list["MiniBatch"]:
        """This rank's micro-batches: views of the planned rows, cut to their longest
        row; the global counts stay the mini-batch's. Without a plan: itself."""
        rows, seq = self.tokens.shape[0], self.tokens.shape[1] - 1
        whole = len(self.plan) == 1 and self.plan[0][1] == seq and len(self.plan[0][0]) == rows
        if not self.plan or whole:  # one micro-batch: the rows' order does not matter
            return [self]
        return [self._rows(torch.tensor(r, device="cpu"), s) for r, s in self.plan]

    def _rows(self, idx: torch.Tensor, seq: int) -> "MiniBatch":
        def cut(t: torch.Tensor | None, extra: int = 0) -> torch.Tensor | None:
            return None if t is None else t[idx, :seq + extra]

        return MiniBatch(
            tokens=cut(self.tokens, 1), loss_mask=cut(self.loss_mask),
            input_mask=cut(self.input_mask), rollout_logprobs=cut(self.rollout_logprobs),
            advantages=self.advantages[idx], sample_weight=self.sample_weight[idx],
            num_responses=self.num_responses, num_tokens=self.num_tokens,
            routing=cut(self.routing), routing_mask=cut(self.routing_mask),
            temperature=None if self.temperature is None else self.temperature[idx],
            staleness=None if self.staleness is None else self.staleness[idx])


@dataclass
class GlobalBatch:
    minibatches: list[MiniBatch]
    num_responses: int  # global, all ranks
    num_tokens: int     # global response tokens the loss sees (model tokens)
    rewards: np.ndarray = field(default_factory=lambda: np.zeros(0))


# ---------------------------------------------------------------- advantages


def group_advantages(samples: list[TrainSample], group_size: int,
                     mode: str = "mean") -> tuple[list[TrainSample], np.ndarray]:
    """Samples ordered group by group and A per sample.

    mean: A = R - mean_group(R) (MiniRL). mean_std: (R - mean) / (std + 1e-6)
    with the unbiased std (GRPO).
    """
    if mode not in ADVANTAGE_MODES:
        raise ConfigError(f"advantage mode {mode!r} not in {ADVANTAGE_MODES}", "consumer.loss.advantage")
    groups: OrderedDict[str, list[TrainSample]] = OrderedDict()
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    ordered, adv = [], []
    for gid, members in groups.items():
        if len(members) != group_size:  # a bug, not input: the assembler refuses a reused group id
            raise InvalidSampleError(f"group {gid!r} has {len(members)} samples, expected "
                                     f"{group_size}; the assembler must pass complete groups")
        r = np.array([m.reward for m in members], dtype=np.float64)
        a = r - r.mean()
        if mode == "mean_std":
            a = a / ((r.std(ddof=1) if len(r) > 1 else 0.0) + 1e-6)
        ordered += members
        adv += a.tolist()
    return ordered, np.asarray(adv, dtype=np.float32)


# ---------------------------------------------------------------- padding


def _routing_rows(s: TrainSample) -> tuple[np.ndarray | None, int]:
    """(routing rows, first input position they cover)."""
    r = s.routed_experts
    if r is None:
        return None, 0
    p, t = len(s.prompt_ids), len(s.response_ids)
    return r, (0 if r.shape[0] == p + t - 1 else p - 1)


def _pad_minibatch(samples: list[TrainSample], adv: np.ndarray, pad_id: int,
                   num_responses: int, num_tokens: int, rows: int, s_len: int) -> MiniBatch:
    """Pad to [rows, s_len]; rows beyond len(samples) are empty (all masks False,
    weight 0) so every data-parallel rank gets the same shapes (Megatron's
    expert-parallel allgather needs equal token counts on every rank)."""
    b = rows
    tokens = np.full((b, s_len + 1), pad_id, dtype=np.int64)
    mask = np.zeros((b, s_len), dtype=bool)
    real = np.zeros((b, s_len), dtype=bool)
    mu = np.zeros((b, s_len), dtype=np.float32)
    # A fleet may mix producers with and without routing (a TP=2 engine cannot capture it on
    # CPU): a sample without rows leaves routing_mask False on its positions, as a cache hit
    # does, so R3 replays the trainer's own routing there and the agreement metric skips them.
    routed = [x.routed_experts for x in samples if x.routed_experts is not None]
    routing = routing_mask = None
    if routed:
        _, n_layers, k = routed[0].shape
        dtype = np.uint8 if all(r.dtype == np.uint8 for r in routed) else np.int32
        # padding rows get experts 0..K-1 (distinct, valid; never affect real tokens)
        routing = np.broadcast_to(np.arange(k, dtype=dtype), (b, s_len, n_layers, k)).copy()
        routing_mask = np.zeros((b, s_len), dtype=bool)
    for i, x in enumerate(samples):
        p, t = len(x.prompt_ids), len(x.response_ids)
        tokens[i, :p] = x.prompt_ids
        tokens[i, p:p + t] = x.response_ids
        # response positions, AND the record's mask: environment tokens get no loss
        mask[i, p - 1:p + t - 1] = True if x.loss_mask is None else x.loss_mask
        real[i, :p + t - 1] = True
        mu[i, p - 1:p + t - 1] = x.logprobs
        if routing is not None and x.routed_experts is not None:
            known, start = _routing_rows(x)
            routing[i, start:start + len(known)] = known
            routing_mask[i, start:start + len(known)] = True
    return MiniBatch(
        tokens=torch.from_numpy(tokens), loss_mask=torch.from_numpy(mask),
        input_mask=torch.from_numpy(real),
        rollout_logprobs=torch.from_numpy(mu),
        advantages=torch.from_numpy(np.pad(adv, (0, b - len(samples)))),
        sample_weight=torch.tensor([x.sample_weight for x in samples] + [0.0] * (b - len(samples)), device="cpu",
                                   dtype=torch.float32),
        num_responses=num_responses, num_tokens=num_tokens,
        routing=None if routing is None else torch.from_numpy(routing),
        routing_mask=None if routing_mask is None else torch.from_numpy(routing_mask),
        temperature=_temperatures(samples, b),
        staleness=torch.tensor([x.staleness for x in samples] + [0] * (b - len(samples)), dtype=torch.int64))


def _temperatures(samples: list[TrainSample], rows: int) -> torch.Tensor | None:
    """float32[rows]: each sample's temperature, 1.0 on padding rows; None if all are 1.0."""
    temps = [float(x.temperature) for x in samples] + [1.0] * (rows - len(samples))
    return None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32)


# ---------------------------------------------------------------- global batch


@dataclass
class MiniBatchShare:
    """One data-parallel rank's slice of one mini-batch, before padding.

    advantages float32[len(samples)]; num_responses / num_tokens: the
    mini-batch's global counts; slice_positions int64[dp, rows]: the input
    positions (P + T - 1) of every rank's rows (0: a padding row), from which
    every rank derives the same padded shape (and, with micro-batches, the same
    plan)."""

    samples: list[TrainSample]
    advantages: np.ndarray
    num_responses: int
    num_tokens: int
    slice_positions: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.slice_positions.shape[1])

    @property
    def seq_len(self) -> int:
        """Input positions of the padded mini-batch: the longest row on any rank."""
        return int(self.slice_positions.max())


@dataclass
class BatchShare:
    """What one data-parallel rank needs of a global batch: its slice of every
    mini-batch, and the batch's global counts."""

    minibatches: list[MiniBatchShare]
    num_responses: int
    num_tokens: int
    rewards: np.ndarray  # float32, every sample of the global batch (metrics)
    dp_rank: int = 0
    """The data-parallel rank it is for (its row of each `slice_positions`)."""


def split_global_batch(samples: list[TrainSample], group_size: int, num_minibatches: int = 1,
                       advantage_mode: str = "mean", dp_size: int = 1) -> list[BatchShare]:
    """Advantages per group, then N contiguous mini-batches (groups stay whole
    when the group count divides evenly), each cut into `dp_size` slices: one
    `BatchShare` per data-parallel rank (rank 0's part of the step)."""
    for s in samples:
        s.validate()
    ordered, adv = group_advantages(samples, group_size, advantage_mode)
    n = len(ordered)
    if num_minibatches < 1 or n < num_minibatches * dp_size:
        raise InvalidSampleError(f"{n} samples cannot fill {num_minibatches} mini-batches x "
                                 f"{dp_size} data-parallel ranks")
    positions = np.array([len(s.prompt_ids) + len(s.response_ids) - 1 for s in ordered], dtype=np.int64)
    shares: list[list[MiniBatchShare]] = [[] for _ in range(dp_size)]
    for mb_idx in np.array_split(np.arange(n), num_minibatches):
        mb_tokens = int(sum(ordered[i].num_model_tokens for i in mb_idx))
        slices = np.array_split(mb_idx, dp_size)
        rows = -(-len(mb_idx) // dp_size)
        slice_positions = np.stack([np.pad(positions[sl], (0, rows - len(sl))) for sl in slices])
        for rank, sl in enumerate(slices):
            shares[rank].append(MiniBatchShare([ordered[i] for i in sl], adv[sl], len(mb_idx), mb_tokens,
                                               slice_positions))
    rewards = np.array([s.reward for s in ordered], dtype=np.float32)
    total = sum(s.num_model_tokens for s in ordered)
    return [BatchShare(mbs, n, total, rewards, rank) for rank, mbs in enumerate(shares)]


def batch_from_share(share: BatchShare, pad_id: int = 0,
                     micro_batch_tokens: int | None = None) -> GlobalBatch:
    """This rank's mini-batches, padded to the shape every data-parallel rank uses,
    each with its micro-batch plan (None: one micro-batch)."""
    minibatches = []
    for m in share.minibatches:
        mb = _pad_minibatch(m.samples, m.advantages, pad_id, num_responses=m.num_responses,
                            num_tokens=m.num_tokens, rows=m.rows, s_len=m.seq_len)
        if micro_batch_tokens:
            mb.plan = micro_batch_plan(list(m.slice_positions), m.rows, micro_batch_tokens)[share.dp_rank]
        minibatches.append(mb)
    return GlobalBatch(minibatches=minibatches, num_responses=share.num_responses,
                       num_tokens=share.num_tokens, rewards=share.rewards)


def build_global_batch(samples: list[TrainSample], group_size: int, num_minibatches: int = 1,
                       advantage_mode: str = "mean", pad_id: int = 0,
                       dp_rank: int = 0, dp_size: int = 1,
                       micro_batch_tokens: int | None = None) -> GlobalBatch:
    """`split_global_batch`, then rank `dp_rank`'s `batch_from_share`: this rank
    keeps slice `dp_rank` of every mini-batch, padded to the same shape on every
    rank, with its micro-batch plan."""
    share = split_global_batch(samples, group_size, num_minibatches, advantage_mode, dp_size)[dp_rank]
    return batch_from_share(share, pad_id, micro_batch_tokens)


def micro_batch_plan(lengths: list[np.ndarray], rows: int,
                     budget: int) -> list[list[tuple[tuple[int, ...], int]]]:
    """Per data-parallel rank, its micro-batches as (rows, input positions).

    lengths[r]: input positions of rank r's real rows (its rows beyond are padding,
    length 0). Each rank orders its rows longest first; group j takes the same
    sorted slots [a, b) on every rank, with S = the longest row in those slots on
    any rank, so shapes agree across ranks; a group grows while (b - a) x S fits
    `budget` (a lone row always fits)."""
    padded = [np.pad(x, (0, rows - len(x))) for x in lengths]
    order = [np.argsort(-x, kind="stable") for x in padded]
    longest = np.max([x[o] for x, o in zip(padded, order)], axis=0)  # per sorted slot
    plans: list[list] = [[] for _ in padded]
    a = 0
    while a < rows:
        seq = max(int(longest[a]), 1)
        b = a + max(1, min(rows - a, budget // seq))
        for plan, o in zip(plans, order):
            plan.append((tuple(int(i) for i in o[a:b]), seq))
        a = b
    return plans
