"""producer.journal.every_tokens on the real vLLM engine and broker: a long turn journaled
while it generates, and continued as the same turn by the producer that resumes it.

One-turn episodes (how a long single-turn sample is journaled) of up to 40 tokens,
journaled every 8 tokens. Producer `a` runs until an episode is >= 12 tokens into its
turn (so an entry holds a partial turn, and the tokens after it are lost), then crashes as
in tests/integration/test_episode_journal.py (same engine, broker, crash and resume). Producer `b`
resumes a's episodes: each record starts with exactly the journaled tokens, log-probs,
versions and routing rows, partial turn included, and its environment saw the turn once,
whole. Without every_tokens the journal holds no partial turn and the test fails.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rlstream.common.config import RlstreamConfig
from tests.fixtures.kafka import make_kafka_settings
from tests.support.journaled_episodes import crash, journaled, resume_on_b, run_until
from tests.support.topics import announce_trainer_start, read_valid_rollouts

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]

G, EVERY, TURN_TOKENS = 4, 8, 40


class OneTurn:
    """The turn ends the episode; the environment says how many tokens it was given. Replays."""

    stop_texts = ()
    resumable = True

    def reset(self, task):
        return task.prompt

    def step(self, turn):
        from rlstream.common.tasks.environment import StepResult

        return StepResult(None, 1.0, True, {"seen_tokens": len(turn.token_ids)})


def config(kafka, model_dir, data, pid: str) -> RlstreamConfig:
    return RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 8},
        "producer": {"producer_id": pid, "group_size": G, "max_tokens": 6, "max_groups_in_flight": 2,
                     "prompts": {"type": "jsonl", "path": str(data)},
                     "episodes": {"env": "calculator", "max_turns": 1, "max_turn_tokens": TURN_TOKENS,
                                  "max_episode_tokens": TURN_TOKENS},
                     "journal": {"lease_s": 1.0, "every_tokens": EVERY}},
        "consumer": {"group_size": G, "groups_per_batch": 2}})


@pytest.mark.timeout(300)  # with the session engine's start when run alone
def test_a_long_turn_cut_by_a_crash_resumes_from_its_last_n_tokens(broker, rollout_engine, tiny_model_dir,
                                                                    tmp_path, monkeypatch):
    from rlstream.common.tasks import envs
    from rlstream.toy.build import ensure_data

    engine = rollout_engine
    monkeypatch.setitem(envs.ENVIRONMENTS, "calculator", OneTurn)
    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    data = tmp_path / "data" / "train.jsonl"
    ensure_data(config(kafka, tiny_model_dir, data, "a"), n_train=64, n_heldout=8)
    announce_trainer_start(kafka, groups_per_batch=2, group_size=G)
    made = crash_a_mid_turn(broker, engine, config(kafka, tiny_model_dir, data, "a"))
    durable = journaled(kafka)
    cut = {k: s for k, s in durable.items() if s.partial}
    assert cut, f"no entry holds a partial turn: {[(k, s.partial) for k, s in durable.items()]}"
    check_journaled_so_far(cut, made, engine.routing_mode == "capture")
    resume_on_b(broker, engine, config(kafka, tiny_model_dir, data, "b"), True, len(durable))
    check_resumed_from_the_partial_turn(read_valid_rollouts(kafka), cut)


def crash_a_mid_turn(broker, engine, cfg: RlstreamConfig) -> dict:
    """Producer a (`cfg`) runs until a turn is 12 tokens in, then crashes; what a made by then,
    by journal key: (response ids, log-probs, routing rows)."""
    from rlstream.producer.service import ProducerService

    a = ProducerService(cfg, broker.bootstrap)
    a.start(engine=engine)
    runner = a.driver.runner
    long = lambda: [t for t in runner._turns if engine.generated(t) >= EVERY + 4]  # noqa: E731
    run_until(a, lambda: long() and a.outbox.unacked_records == 0, 60, "a turn 12 tokens in")
    # what a made: a generating turn so far, or a finished turn whose environment step is pending
    # (its entry still holds the turn's last N-token write)
    made = {f"ep:{t.rsplit('#t', 1)[0]}": (p.response_ids, p.logprobs, p.routed_experts)
            for t in runner._turns if (p := engine.partial(t)) is not None}
    made |= {f"ep:{ep.group_id}#{ep.sample_idx}": (ep.response_ids, ep.logprobs, ep.routing)
             for ep, _, _ in runner._pending.values()}
    crash(a, engine)
    return made


def check_journaled_so_far(cut: dict, made: dict, captured_routing: bool) -> None:
    """The journal holds a's turn so far, up to its last N-token write (routing rows as of the
    write's step, when the engine captures them)."""
    for key, s in cut.items():
        ids, logprobs, routing = made[key]
        n = s.response.size
        assert s.partial == n and n % EVERY == 0 and n <= ids.size
        assert s.turns == 0 and s.model_turns == [] and s.holder == "a"
        assert s.response.tolist() == ids[:n].tolist()
        assert np.array_equal(s.logprobs, np.minimum(logprobs[:n], 0))
        if captured_routing:  # the session's engine: rows as of the write's step
            assert s.routing.shape[0] == s.prompt_ids.size + n - 1
            assert np.array_equal(s.routing, routing[:s.routing.shape[0]])


def check_resumed_from_the_partial_turn(records, cut: dict) -> None:
    """Each episode once; each resumed record starts with its entry's tokens, log-probs,
    versions and routing, and its environment saw the one turn once, whole."""
    assert Counter((r.group_id, r.sample_idx) for r in records).most_common(1)[0][1] == 1  # each once
    by_key = {f"ep:{r.group_id}#{r.sample_idx}": r for r in records}
    for key, s in cut.items():
        r, n = by_key[key], s.response.size
        assert r.rollout_id == s.rollout_id and r.producer_id == "a"
        assert r.response_ids[:n].tolist() == s.response.tolist() and np.array_equal(r.logprobs[:n], s.logprobs)
        versions = np.repeat(r.token_versions[:, 0], r.token_versions[:, 1]) if r.token_versions is not None\
            else np.full(r.num_tokens, r.policy_version)
        assert versions[:n].tolist() == s.versions.tolist()
        if s.routing is not None:
            assert np.array_equal(r.routed_experts[:s.routing.shape[0]], s.routing)
        # one model turn, given to the environment once and whole (journaled part and the rest)
        assert r.reward_info["turns"] == 1 and r.reward_info["seen_tokens"] == r.num_tokens > n
        assert r.num_tokens <= TURN_TOKENS
