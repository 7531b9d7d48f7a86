"""common/record/schema.py's value limits: the bounds sit where the engine and the trainer
need them (vLLM's temperature floor read from vLLM's own source), and values at the
bounds are accepted."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from rlstream.common.errors import InvalidRecordError
from rlstream.common.record import (
    MAX_TEMPERATURE,
    MIN_LOGPROB,
    MIN_TEMPERATURE,
    RecordLimits,
    decode,
    encode,
)
from tests.fixtures.kafka import realistic_rollout


def _small():
    return realistic_rollout(response_tokens=6, prompt_tokens=3, layers=2, top_k=2, num_experts=4)


def _vllm_constants() -> dict[str, float]:
    """vLLM's module-level sampling constants, parsed (importing vLLM takes ~10 s)."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    tree = ast.parse((root / "sampling_params.py").read_text())
    return {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and t.id in ("_SAMPLING_EPS", "_MAX_TEMP")}


@pytest.mark.timeout(30)
def test_the_temperature_floor_is_the_lowest_vllm_samples_at():
    c = _vllm_constants()
    # below _SAMPLING_EPS vLLM is greedy; in (0, _MAX_TEMP) it raises the temperature to _MAX_TEMP
    assert c["_SAMPLING_EPS"] < MIN_TEMPERATURE == c["_MAX_TEMP"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("t", [MIN_TEMPERATURE, 0.7, 1.0, MAX_TEMPERATURE])
def test_temperatures_in_range_round_trip(t):
    r = _small()
    r.temperature = t
    assert decode(encode(r)).temperature == t


@pytest.mark.timeout(30)
def test_logprobs_and_rewards_at_the_bounds_are_accepted():
    r = _small()
    lp = np.array(r.logprobs)
    lp[0] = MIN_LOGPROB
    r.logprobs, r.reward = lp, -1e6
    out = decode(encode(r))
    assert out.logprobs[0] == MIN_LOGPROB and out.reward == -1e6


@pytest.mark.timeout(30)
def test_a_consumer_may_set_its_own_reward_bound():
    r = _small()
    r.reward = 50.0
    buf = encode(r)
    with pytest.raises(InvalidRecordError) as e:
        decode(buf, RecordLimits(max_abs_reward=10.0))
    assert e.value.field == "reward" and "10" in e.value.reason
