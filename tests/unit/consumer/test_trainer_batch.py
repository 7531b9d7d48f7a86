"""consumer/train/batch.py: positions, padding, routing scopes, data-parallel slices."""
from __future__ import annotations

import numpy as np
import pytest

from rlstream.common.config import ParallelSettings
from rlstream.common.errors import ConfigError, InvalidSampleError, ParallelLayoutError
from rlstream.consumer.train.batch import TrainSample, build_global_batch
from rlstream.consumer.train.parallel import ParallelLayout

L, K = 2, 2


def sample(p, t, reward, gid, scope="full", weight=1.0):
    prompt = np.arange(10, 10 + p, dtype=np.int32)
    resp = np.arange(30, 30 + t, dtype=np.int32)
    rows = p + t - 1 if scope == "full" else t
    routing = None
    if scope:
        # row value encodes its input position so placement can be checked
        start = 0 if scope == "full" else p - 1
        pos = np.arange(start, start + rows)
        routing = np.stack([pos % 8, (pos + 1) % 8], -1)[:, None, :].repeat(L, 1).astype(np.uint8)
    return TrainSample(prompt, resp, -np.arange(1, t + 1, dtype=np.float32) / 10, reward, gid,
                       routing, weight)


def test_positions_masks_and_padding():
    gb = build_global_batch([sample(3, 2, 1.0, "a"), sample(2, 4, 0.0, "a")], group_size=2)
    mb = gb.minibatches[0]
    assert mb.tokens.shape == (2, 6) and mb.loss_mask.shape == (2, 5)
    assert mb.tokens[0].tolist() == [10, 11, 12, 30, 31, 0]
    assert mb.loss_mask[0].tolist() == [False, False, True, True, False]
    assert mb.loss_mask[1].tolist() == [False, True, True, True, True]
    assert mb.input_mask[0].tolist() == [True, True, True, True, False]
    # targets at response positions are the response tokens
    assert mb.tokens[0, 1:][mb.loss_mask[0]].tolist() == [30, 31]
    assert mb.rollout_logprobs[1][mb.loss_mask[1]].tolist() == pytest.approx([-.1, -.2, -.3, -.4])
    assert mb.advantages.tolist() == [0.5, -0.5]
    assert (gb.num_responses, gb.num_tokens, mb.num_responses, mb.num_tokens) == (2, 6, 2, 6)


def test_routing_scopes_land_on_input_positions():
    full = build_global_batch([sample(3, 3, 1.0, "a"), sample(3, 3, 0.0, "a")], 2).minibatches[0]
    short = build_global_batch([sample(3, 3, 1.0, "a", scope="response"),
                                sample(3, 3, 0.0, "a", scope="response")], 2).minibatches[0]
    assert full.routing.shape == (2, 5, L, K)
    assert full.routing[0, :, 0, 0].tolist() == [0, 1, 2, 3, 4]  # row i = position i
    assert short.routing_mask[0].tolist() == [False, False, True, True, True]
    assert short.routing[0, 2:, 0, 0].tolist() == [2, 3, 4]


def test_a_fleet_with_and_without_routing_shares_a_mini_batch():
    """A producer without routing (a TP=2 engine on CPU) beside one with it: the batch builds (it
    raised, and the trainer exited, on the cluster twin), the unrouted sample's positions have
    routing_mask False, so R3 uses the trainer's own routing there and agreement skips them."""
    mb = build_global_batch([sample(3, 3, 1.0, "a"), sample(3, 3, 0.0, "a", scope=None)], 2).minibatches[0]
    assert mb.routing.shape == (2, 5, L, K)
    assert mb.routing_mask[0].tolist() == [True] * 5 and mb.routing_mask[1].tolist() == [False] * 5
    none = build_global_batch([sample(3, 3, 1.0, "a", scope=None), sample(3, 3, 0.0, "a", scope=None)], 2)
    assert none.minibatches[0].routing is None


def test_data_parallel_slices_have_equal_shapes_and_global_counts():
    samples = [sample(2 + i % 3, 2 + i, float(i % 2), f"g{i // 2}") for i in range(6)]
    slices = [build_global_batch(samples, 2, num_minibatches=1, dp_rank=r, dp_size=4)
              for r in range(4)]
    shapes = {tuple(s.minibatches[0].tokens.shape) for s in slices}
    assert len(shapes) == 1  # 6 samples over 4 ranks: 2,2,1,1 rows padded to 2
    last = slices[3].minibatches[0]
    assert last.sample_weight.tolist() == [1.0, 0.0] and not last.loss_mask[1].any()
    assert all(s.minibatches[0].num_responses == 6 for s in slices)


def test_mean_std_and_errors():
    samples = [sample(2, 2, r, "g") for r in (1.0, 0.0, 0.0, 1.0)]
    adv = build_global_batch(samples, 4, advantage_mode="mean_std").minibatches[0].advantages
    assert adv.tolist() == pytest.approx([0.8660, -0.8660, -0.8660, 0.8660], abs=1e-3)
    with pytest.raises(InvalidSampleError, match="expected 4"):
        build_global_batch(samples[:3], 4)
    bad = sample(2, 2, 1.0, "g")
    bad.logprobs = np.zeros(5, dtype=np.float32)
    with pytest.raises(InvalidSampleError, match="logprobs shape"):
        build_global_batch([bad], 1)
    with pytest.raises(InvalidSampleError, match="mini-batches"):
        build_global_batch(samples, 4, num_minibatches=8)
    weightless = sample(2, 2, 1.0, "g", weight=float("nan"))
    with pytest.raises(InvalidSampleError, match="sample_weight"):
        build_global_batch([weightless], 1)


def test_parallel_layout_validation():
    ParallelLayout(dp=2, ep=2).validate(2)
    with pytest.raises(ParallelLayoutError, match="world size"):
        ParallelLayout(dp=2).validate(1)
    ParallelLayout(tp=2).validate(2)
    ParallelLayout(tp=2, dp=2, ep=2).validate(4)
    with pytest.raises(ParallelLayoutError, match="world size"):
        ParallelLayout(tp=2, dp=2).validate(2)
    with pytest.raises(ParallelLayoutError, match="divide") as e:
        ParallelLayout(dp=2, ep=4).validate(2)
    assert e.value.key == "consumer.parallel.expert"


def test_layout_from_settings_and_world_size():
    assert ParallelLayout.of(ParallelSettings(), 1) == ParallelLayout(1, 1, 1)
    assert ParallelLayout.of(ParallelSettings(tensor=2, expert=2), 4) == ParallelLayout(tp=2, ep=2, dp=2)
    with pytest.raises(ConfigError, match="data-parallel") as e:
        ParallelLayout.of(ParallelSettings(tensor=2, expert=2), 2)
    assert e.value.key == "consumer.parallel.expert"
    with pytest.raises(ConfigError, match="multiple") as e:
        ParallelLayout.of(ParallelSettings(tensor=2), 3)
    assert e.value.key == "consumer.parallel.tensor"


def test_from_rollout_keeps_the_record_and_takes_the_gate_weight():
    from rlstream.common.record import Rollout, validate

    r = Rollout(rollout_id="r", group_id="g", sample_idx=0, group_size=1,
                prompt_ids=np.array([5, 6], np.int32), response_ids=np.array([7, 8, 9], np.int32),
                logprobs=np.array([-.1, -.2, -.3], np.float32), policy_version=0, reward=1.0)
    validate(r)  # what the reader did: TrainSample.validate does not repeat the shape checks
    s = TrainSample.from_rollout(r, 0.5)
    assert s.from_record and (s.group_id, s.reward, s.sample_weight) == ("g", 1.0, 0.5)
    assert s.prompt_ids is r.prompt_ids and s.logprobs is r.logprobs  # no copies
    mb = build_global_batch([s], 1).minibatches[0]
    assert mb.tokens[0].tolist() == [5, 6, 7, 8, 9] and mb.sample_weight.tolist() == [0.5]
    assert s.temperature == 1.0 and mb.temperature is None  # all 1.0: the division is skipped


def test_temperature_travels_per_sample_with_padding_rows_at_one():
    import dataclasses

    from rlstream.common.record import Rollout

    r = Rollout(rollout_id="r", group_id="a", sample_idx=0, group_size=2, prompt_ids=np.array([5, 6], np.int32),
                response_ids=np.array([7], np.int32), logprobs=np.array([-.1], np.float32), policy_version=0,
                reward=1.0, temperature=0.7)
    hot = TrainSample.from_rollout(r)
    cold = dataclasses.replace(sample(2, 2, 0.0, "a", scope=None), temperature=1.3)
    gb = build_global_batch([hot, cold], group_size=2, dp_rank=0, dp_size=1)
    assert gb.minibatches[0].temperature.tolist() == pytest.approx([0.7, 1.3])
    # three samples over two data-parallel ranks: rank 1 gets one sample and a padding row at 1.0
    three = [dataclasses.replace(sample(2, 2, float(i), "b", scope=None), temperature=0.5) for i in range(3)]
    mb = build_global_batch(three, group_size=3, dp_rank=1, dp_size=2).minibatches[0]
    assert mb.temperature.tolist() == [0.5, 1.0]
    with pytest.raises(InvalidSampleError, match="temperature"):
        build_global_batch([dataclasses.replace(cold, temperature=0.0), hot], group_size=2)


def test_logprobs_are_taken_at_each_rows_temperature():
    import torch

    from rlstream.consumer.train.logprobs import logprobs_from_logits

    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 3, 11, generator=g), torch.randint(0, 11, (2, 3), generator=g)
    t = torch.tensor([0.7, 1.3])
    lp, ent = logprobs_from_logits(logits, targets, with_entropy=True, temperature=t)
    for b in range(2):
        want = torch.log_softmax(logits[b] / t[b], -1)
        assert torch.allclose(lp[b], want.gather(-1, targets[b, :, None])[:, 0])
        assert torch.allclose(ent[b], -(want.exp() * want).sum(-1))
    assert torch.equal(logprobs_from_logits(logits, targets), logprobs_from_logits(logits, targets, temperature=None))
    assert not torch.allclose(lp, logprobs_from_logits(logits, targets))


def test_multi_turn_mask_keeps_env_tokens_out_of_the_loss_but_routes_every_position():
    """Record schema 2: loss_mask (the batch's) = response positions AND the record's model mask;
    num_tokens (the cispo normaliser) counts model tokens; routing covers env positions too."""
    from rlstream.common.record import Rollout, validate
    from rlstream.consumer.train.losses import LOSSES, LossInputs
    from rlstream.common.config import LossSettings
    import torch

    mask = np.array([1, 1, 0, 0, 1], dtype=bool)  # model, model, env, env, model
    lp = np.array([-.1, -.2, 0, 0, -.5], np.float32)
    rows = 3 + 5 - 1
    routing = np.stack([np.arange(rows) % 8, (np.arange(rows) + 1) % 8], -1)[:, None, :].repeat(L, 1)
    r = Rollout(rollout_id="r", group_id="g", sample_idx=0, group_size=2,
                prompt_ids=np.array([5, 6, 7], np.int32), response_ids=np.array([8, 9, 10, 11, 12], np.int32),
                logprobs=lp, policy_version=0, reward=1.0, loss_mask=mask,
                routed_experts=routing.astype(np.uint8), num_experts=8)
    validate(r)
    other = sample(3, 5, 0.0, "g")
    gb = build_global_batch([TrainSample.from_rollout(r), other], 2)
    mb = gb.minibatches[0]
    assert mb.loss_mask[0].tolist() == [False, False, True, True, False, False, True]
    assert mb.loss_mask[1].tolist() == [False, False, True, True, True, True, True]
    assert mb.routing_mask[0].all() and mb.routing_mask[1].all()  # R3 replays env positions too
    assert (gb.num_tokens, mb.num_tokens) == (3 + 5, 3 + 5)
    # the loss ignores whatever sits at environment positions (log pi there is garbage to it)
    base = torch.from_numpy(np.where(mb.loss_mask.numpy(), -0.3, 0.0).astype(np.float32))
    noisy = base.clone()
    noisy[0, 4:6] = -7.0  # env positions of sample 0 (response tokens 2, 3 at P - 1 + t)
    for name in ("minirl", "cispo"):
        out = []
        for logp in (base, noisy):
            inp = LossInputs(logprobs=logp, old_logprobs=logp, rollout_logprobs=mb.rollout_logprobs,
                             mask=mb.loss_mask, advantages=mb.advantages, sample_weight=mb.sample_weight,
                             num_responses=mb.num_responses, num_tokens=mb.num_tokens)
            loss, m = LOSSES[name].fn(inp, LossSettings())
            out.append((float(loss), m["tokens"], m["clip_frac"], m["is_weight_mean"]))
        assert out[0] == out[1], name
        assert out[0][1] == 8


def test_hand_built_samples_with_a_bad_mask_are_refused():
    s = sample(3, 2, 1.0, "a")
    s.loss_mask = np.array([1, 0, 1], dtype=bool)
    with pytest.raises(InvalidSampleError, match="loss_mask"):
        build_global_batch([s, sample(3, 2, 0.0, "a")], group_size=2)
