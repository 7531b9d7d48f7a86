"""Issue 25's crash test: two producer processes on the real vLLM CPU engine and the
bundled broker; one is SIGKILLed mid-episode (twice: with durability on, then off).

It runs tests/bench/episodes.py at smoke size, exactly as tests/integration/
test_bench_smoke.py runs every other bench (which therefore skips this one: one run
of three engine starts, not two), and asserts on what the bench measured:
- every episode the killed process held at the "on" kill is published, once;
- no episode is in the rollouts topic twice (nor under two rollout ids);
- each resumed record starts with exactly the tokens the killed process had journaled
  (its tokens up to its last completed turn: what it had made, as far as it was durable).
tests/integration/test_episode_journal.py covers the same in one process, faster, with
the crash between a record's acknowledgement and its journal tombstone.
"""
from __future__ import annotations

import sys

import pytest

from tests.support.benches import BENCH_DIR, BENCHES, last_json_object, run_bench

pytestmark = [pytest.mark.broker, pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(BENCHES["episodes"][1] + 60)
def test_a_sigkilled_producers_episodes_are_published_once_with_the_tokens_it_made(tmp_path):
    cmd = [sys.executable, str(BENCH_DIR / "episodes.py"), "--smoke", "--work-dir", str(tmp_path)]
    code, out, err, seconds = run_bench(cmd, BENCHES["episodes"][1])
    assert code == 0, f"episodes.py --smoke exited {code}:\n{err[-3000:]}"
    r = last_json_object(out)
    missing = [k for k in BENCHES["episodes"][0] if k not in r]
    assert not missing and r["smoke"] is True, f"the bench's JSON lacks {missing}"
    on = [c for c in r["crashes"] if c["arm"] == "on"]
    assert on and all(c["in_flight"] > 0 for c in on), f"no episode was in flight at a kill: {r['crashes']}"
    assert all(c["resumed_published"] == c["in_flight"] for c in on), r["crashes"]  # every one published
    assert r["resumed_unpublished"] == 0
    assert r["episodes_published_twice"] == 0 and r["published_twice_under_two_rollout_ids"] == 0, r
    assert r["resumed_prefix_mismatches"] == 0, r
    print(f"episodes --smoke: {seconds:.1f} s; {r['crashes']}")
