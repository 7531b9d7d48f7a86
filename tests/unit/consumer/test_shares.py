"""consumer/ranks/shares.py: a rank's share of the global batch as flat tensors.

What a rank builds from its received share equals, tensor for tensor, what
`build_global_batch` gives that rank from the whole batch (the multi-rank
equality test relies on it), and the wire carries about the bytes of its own
samples, not the batch's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rlstream.common.errors import RankProtocolError
from rlstream.consumer.train.batch import (
    TrainSample,
    batch_from_share,
    build_global_batch,
    split_global_batch,
)
from rlstream.consumer.ranks.shares import MAGIC, pack, sample_bytes, unpack


def samples(n_groups: int, g: int, seed: int, routing=np.uint8, scope="mixed", layers=3, k=2):
    rng = np.random.default_rng(seed)
    out = []
    for gi in range(n_groups):
        prompt = rng.integers(0, 1000, int(rng.integers(1, 9))).astype(np.int32)
        for i in range(g):
            t = int(rng.integers(1, 12))
            p = len(prompt)
            rows = p + t - 1 if scope == "full" or (scope == "mixed" and gi % 2) else t
            r = None if routing is None else rng.integers(0, 300 if routing == np.uint16 else 128,
                                                          (rows, layers, k)).astype(routing)
            out.append(TrainSample(prompt, rng.integers(0, 1000, t).astype(np.int32),
                                   -rng.random(t).astype(np.float32), float(rng.integers(0, 2)) + 0.1 * i,
                                   f"g{gi}", r, float(rng.uniform(0.2, 1.0)),
                                   temperature=float(rng.choice([0.7, 1.0, 1.3])),
                                   loss_mask=_turns(rng, t) if i % 2 else None, staleness=int(rng.integers(0, 12))))
    return out


def _turns(rng, t: int) -> np.ndarray:
    """A multi-turn loss mask: model tokens first, then environment and model runs."""
    mask = rng.random(t) < 0.6
    mask[0] = True
    return mask


def assert_same_batch(a, b):
    assert (a.num_responses, a.num_tokens) == (b.num_responses, b.num_tokens)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert len(a.minibatches) == len(b.minibatches)
    for x, y in zip(a.minibatches, b.minibatches):
        for f in ("tokens", "loss_mask", "input_mask", "rollout_logprobs", "advantages", "sample_weight",
                  "routing", "routing_mask", "temperature", "staleness"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None), f
            if u is not None:
                assert u.dtype == v.dtype and torch.equal(u, v), f
        assert (x.num_responses, x.num_tokens, x.plan) == (y.num_responses, y.num_tokens, y.plan)


@pytest.mark.parametrize("routing", [np.uint8, np.uint16, None])
@pytest.mark.parametrize("dp,n_mb", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 1)])
def test_a_received_share_builds_what_build_global_batch_builds(routing, dp, n_mb):
    batch = samples(6, 4, seed=dp * 10 + n_mb, routing=routing)
    shares = split_global_batch(batch, 4, n_mb, "mean_std", dp)
    for rank, share in enumerate(shares):
        wire = [t.clone() for t in pack(share).tensors]  # what the receiving rank holds
        received = unpack(wire)
        assert received.dp_rank == rank
        got = batch_from_share(received, pad_id=0, micro_batch_tokens=24)
        want = build_global_batch(batch, 4, n_mb, "mean_std", pad_id=0, dp_rank=rank, dp_size=dp,
                                  micro_batch_tokens=24)
        assert any(len(mb.plan) > 1 for mb in got.minibatches)  # several micro-batches planned
        assert_same_batch(got, want)


def test_a_rank_receives_about_its_own_share_not_the_batch():
    """rank_ingress_share: the tensors of a share / the bytes of its samples.
    Realistic rows (long responses, routing) make the header negligible."""
    rng = np.random.default_rng(0)
    batch = []
    for gi in range(8):
        prompt = rng.integers(0, 1000, 64).astype(np.int32)
        for i in range(4):
            t = int(rng.integers(200, 400))
            batch.append(TrainSample(prompt, rng.integers(0, 1000, t).astype(np.int32),
                                     -rng.random(t).astype(np.float32), float(i % 2), f"g{gi}",
                                     rng.integers(0, 64, (63 + t, 4, 2)).astype(np.uint8)))
    total = sum(sample_bytes(s) for s in split_global_batch(batch, 4, 2, "mean", 1))
    for share in split_global_batch(batch, 4, 2, "mean", 2):
        ratio = pack(share).nbytes / sample_bytes(share)
        assert 1.0 <= ratio <= 1.02, ratio
        assert sample_bytes(share) < 0.55 * total  # half the batch, not all of it


def test_mixed_routing_types_travel_widened_and_values_kept():
    batch = samples(2, 2, seed=3, routing=np.uint8, scope="full")
    batch[1].routed_experts = batch[1].routed_experts.astype(np.uint16)
    share = split_global_batch(batch, 2, 1, "mean", 1)[0]
    got = unpack(pack(share).tensors)
    for a, b in zip(got.minibatches[0].samples, share.minibatches[0].samples):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_a_foreign_or_truncated_share_is_refused():
    share = split_global_batch(samples(2, 2, seed=4), 2, 1, "mean", 1)[0]
    header, tokens, floats, routing = pack(share).tensors
    bad = header.clone()
    bad[0] = MAGIC + 1
    with pytest.raises(RankProtocolError, match="not a batch share"):
        unpack([bad, tokens, floats, routing])
    with pytest.raises(RankProtocolError, match="truncated"):
        unpack([header, tokens[:-1], floats, routing])
