"""A reasoning-gym task end to end on the tiny model, nothing faked:
configs/tiny-reasoning-gym.yaml as shipped (chain_sum from reasoning-gym 0.1.25,
compact prompts, the dataset's own score as the reward, dynamic sampling on).

The harness writes the task's held-out split and one epoch of its training
range (ops/toy/build.py `task_files`), warm-starts the tiny model on it by
SFT, then runs the real pipeline as processes (`rlstream broker`, one
`rlstream producer` with vLLM generating chain_sum prompts itself, one
`rlstream consumer` with Megatron-core) for a fixed number of versions, and
checks:

- the task files: held-out and train disjoint, compact chain_sum prompts whose
  answers are right;
- every record on the topic was scored by chain_sum's own scorer, and some
  got partial credit (which exact match never gives);
- dynamic sampling filtered groups of equal rewards (the warm start solves a
  minority: many groups are all wrong) and the trainer still trained full
  batches; published = every outcome (filtered included) + held;
- every process exits 0.

Length: SFT (~15 s on an idle 2-core machine, minutes under load) + ~15 s
startup + 20 versions + ~20 s shutdown.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.common.config import load_config
from rlstream.harness.demo import prepare_warm
from rlstream.harness.runs import StopRule, run_rl

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.broker]

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = 20


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(900)
def test_reasoning_gym_task_trains_end_to_end(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny-reasoning-gym.yaml", [
        f"model.path={tmp_path / 'tiny-model'}", f"demo.work_dir={tmp_path / 'demo'}"], environ={})
    assert cfg.producer.prompts.type == "reasoning_gym" and cfg.consumer.filters_zero_variance
    B, G = cfg.consumer.groups_per_batch, cfg.consumer.group_size
    warm = prepare_warm(cfg)
    assert 0.05 <= warm.accuracy <= 0.5, f"warm start outside its band: {warm.accuracy}"

    train, heldout = rows(warm.train_path), rows(warm.heldout_path)
    assert len(heldout) == cfg.producer.prompts.heldout
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}, "held-out prompts in training"
    for r in train[:200] + heldout:
        assert r["prompt"].endswith("=") and eval(r["prompt"][:-1]) == int(r["answer"]), r  # noqa: S307

    res = run_rl(cfg, warm, "rg-e2e", StopRule(max_versions=VERSIONS, max_seconds=480), tick_s=3.0,
                 eval_every_s=60.0)

    assert res.error is None, res.error
    assert set(res.exit_codes) == {"broker", "producer-0", "consumer"}
    assert all(code == 0 for code in res.exit_codes.values()), res.exit_codes
    acc = res.accounting
    assert acc["published"] and acc["published"] == acc["distinct_ids"], acc
    assert acc["ok"], f"records not accounted for: {acc}"
    assert acc["scored_by"] == {"reasoning_gym:chain_sum": acc["published"]}, acc
    assert acc["partial_rewards"] > 0, "no partial credit: the rewards are not chain_sum's own score"
    assert acc["filtered"] > 0 and acc["filtered"] % G == 0, acc
    assert acc["trained"] >= VERSIONS * B * G * 0.9, acc
    assert res.versions >= VERSIONS * 0.9, f"only {res.versions} versions in {res.rl_seconds:.0f} s"
