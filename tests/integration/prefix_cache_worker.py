"""test_weight_transfer.py's prefix-cache check, in a process of its own.

It needs an engine with prefix caching, which the session engine (tests/fixtures/
producer.py) does not have. RolloutEngine runs vLLM's engine core in-process, and
closing a second in-process engine tears down vLLM's process-global parallel state:
the session engine failed every later step ("pipeline model parallel group is not
initialized") when a test using it ran after this one. So this engine lives here.

    python -m tests.integration.prefix_cache_worker MODEL_DIR TMP_DIR   # exit 0: every check held
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tests.support.engine import greedy
from tests.support.weights import perturbed, read_weights, write_version


def check(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlstream.common.config import EngineSettings
    from rlstream.producer.engine import RolloutEngine

    settings = EngineSettings(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
                              routing="off", enable_prefix_caching=True, block_size=32)
    # 105 characters: three full blocks (CPU attention wants multiples of 32; its default of 128
    # would never fill a block with rlstream's short prompts)
    prompt = ["+".join(str(i) for i in range(10, 45)) + "="]
    with RolloutEngine(settings, tiny_model_dir) as engine:
        def run(salted: bool) -> tuple[np.ndarray, int]:
            engine.salt_prefix_cache = salted
            before = engine.stats.prefix_cached_tokens
            lp = greedy(engine, prompt, max_tokens=4)
            return lp, engine.stats.prefix_cached_tokens - before

        run(salted=False)  # unsalted blocks computed by version 0
        v0, _ = run(salted=True)
        again, hit = run(salted=True)
        assert hit >= 64 and np.array_equal(again, v0)  # the cache works within a version
        engine.reload_weights(write_version(tmp_path / "v1", perturbed(read_weights(tiny_model_dir), 1),
                                            tiny_model_dir), 1)
        salted, hit = run(salted=True)
        assert hit == 0  # the new version's salt: nothing of version 0 is reused
        stale, stale_hit = run(salted=False)
        assert stale_hit >= 64 and np.abs(stale - salted).max() > 1e-3  # what an unsalted cache would serve
        assert engine._engine.reset_prefix_cache()
        fresh, hit = run(salted=True)
        assert hit == 0
        np.testing.assert_allclose(salted, fresh, atol=1e-6)  # the salted run computed under the new weights


if __name__ == "__main__":
    check(Path(sys.argv[1]), Path(sys.argv[2]))
