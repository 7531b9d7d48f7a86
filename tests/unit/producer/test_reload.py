"""Weight reload (producer/reload.py): stage, verify, reload, roll back, with a
fake engine (pure logic; the real engine's reloads are in tests/integration)."""
from __future__ import annotations

from pathlib import Path

import pytest

from common import metrics
from common.control.messages import WeightsReady
from common.errors import WeightReloadError
from common.weights.store import WEIGHTS_FILE, sha256_file
from producer.reload import Reloader


class FakeEngine:
    """Records loads; `fail` makes the next loads of those directories raise."""

    def __init__(self):
        self.version = 0
        self.loads: list[tuple[Path, int, bytes]] = []
        self.fail: set[str] = set()

    def reload_weights(self, weights_dir, version):
        d = Path(weights_dir)
        if d.name in self.fail:
            raise OSError(f"load of {d} failed halfway")
        self.loads.append((d, version, (d / WEIGHTS_FILE).read_bytes()))
        self.version = version
        return 0.0


def publish(root: Path, version: int, payload: bytes) -> WeightsReady:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / WEIGHTS_FILE).write_bytes(payload)
    return WeightsReady(version=version, uri=d.as_uri(), sha256=sha256_file(d / WEIGHTS_FILE), bytes=len(payload))


def failures() -> float:
    return metrics.value("rlstream_producer_weight_reload_failures_total")


@pytest.fixture
def setup(tmp_path):
    engine = FakeEngine()
    reloader = Reloader(engine, tmp_path / "base")
    yield engine, reloader, tmp_path / "store"
    reloader.close()
    assert not reloader.stage_root.exists()


def test_a_newer_verified_version_is_staged_and_served(setup):
    engine, reloader, store = setup
    assert reloader.apply(publish(store, 1, b"one"))
    assert engine.version == 1 and reloader.loaded == reloader.stage_root / "a"
    assert engine.loads[-1][2] == b"one" and metrics.value("rlstream_producer_policy_version") == 1
    assert reloader.apply(publish(store, 2, b"two"))  # the other slot: the served one stays intact
    assert reloader.loaded == reloader.stage_root / "b" and engine.loads[-1][2] == b"two"
    assert reloader.apply(publish(store, 3, b"three")) and reloader.loaded == reloader.stage_root / "a"


def test_the_staged_copy_survives_the_store_pruning_the_version(setup):
    engine, reloader, store = setup
    msg = publish(store, 1, b"one")
    reloader.apply(msg)
    (store / "v1" / WEIGHTS_FILE).unlink()  # the consumer's keep-K pruning
    assert (reloader.loaded / WEIGHTS_FILE).read_bytes() == b"one"


def test_old_and_equal_versions_are_ignored_without_counting(setup):
    engine, reloader, store = setup
    reloader.apply(publish(store, 2, b"two"))
    before, loads = failures(), len(engine.loads)
    assert not reloader.apply(publish(store, 1, b"one"))
    assert not reloader.apply(WeightsReady(version=2, uri="file:///nowhere", sha256="0" * 64, bytes=1))
    assert failures() == before and len(engine.loads) == loads and engine.version == 2


@pytest.mark.parametrize("tamper", ["sha256", "bytes", "missing"])
def test_a_version_that_does_not_verify_is_refused_and_counted(setup, tamper, caplog):
    engine, reloader, store = setup
    msg = publish(store, 1, b"one")
    if tamper == "sha256":
        msg = msg.model_copy(update={"sha256": "f" * 64})
    elif tamper == "bytes":
        msg = msg.model_copy(update={"bytes": 99})
    else:
        msg = msg.model_copy(update={"uri": (store / "gone").as_uri()})
    before = failures()
    assert not reloader.apply(msg)
    assert failures() == before + 1 and engine.version == 0 and engine.loads == []
    assert reloader.loaded == store.parent / "base"
    assert "refusing weight version 1" in caplog.text and "still serving version 0" in caplog.text


def test_a_load_failing_halfway_restores_the_served_version(setup):
    engine, reloader, store = setup
    reloader.apply(publish(store, 1, b"one"))  # served from slot a
    engine.fail = {"b"}
    before = failures()
    assert not reloader.apply(publish(store, 2, b"two"))
    assert failures() == before + 1 and engine.version == 1
    assert engine.loads[-1] == (reloader.stage_root / "a", 1, b"one") and reloader.loaded == reloader.stage_root / "a"


def test_a_failed_rollback_raises_an_rlstream_error(setup):
    engine, reloader, store = setup
    reloader.apply(publish(store, 1, b"one"))
    engine.fail = {"a", "b"}
    with pytest.raises(WeightReloadError, match="inconsistent"):
        reloader.apply(publish(store, 2, b"two"))
