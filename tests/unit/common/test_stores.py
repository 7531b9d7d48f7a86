"""Weight store and checkpoints: atomic, verified, pruned."""

import pytest
import torch

from rlstream.common.errors import WeightStoreError
from rlstream.common.weights.store import WeightStore, verify
from rlstream.consumer.checkpoint.files import CheckpointManager, CheckpointState


def test_weight_store_write_verify_prune(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    ws = WeightStore(tmp_path / "w", keep=2)
    anns = [ws.write(v, {"w": torch.full((4,), float(v))}, base) for v in (1, 2, 3)]
    assert ws.versions() == [2, 3]
    d = verify(anns[-1]["uri"], anns[-1]["sha256"], anns[-1]["bytes"])
    assert (d / "config.json").exists()
    with pytest.raises(WeightStoreError, match="missing"):
        verify(anns[0]["uri"], anns[0]["sha256"], anns[0]["bytes"])


def test_weight_store_detects_tampering(tmp_path):
    ws = WeightStore(tmp_path / "w")
    a = ws.write(1, {"w": torch.zeros(64)}, tmp_path)
    f = ws.path(1) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="sha256"):
        verify(a["uri"], a["sha256"], a["bytes"])
    f.write_bytes(bytes(data[:-8]))
    with pytest.raises(WeightStoreError, match="bytes"):
        verify(a["uri"], a["sha256"], a["bytes"])


def test_checkpoint_roundtrip_and_incomplete_ignored(tmp_path):
    cm = CheckpointManager(tmp_path, keep=2)
    assert cm.latest() is None
    for step in (1, 2, 3):
        cm.save(CheckpointState(step, step, {0: 10 * step, 1: 5}, [[0, 31, "a"], [1, 5, "b"]], {"trained": 8.0 * step}),
                {"model": {"w": torch.ones(2) * step}})
    # a crash mid-write leaves a temp dir and a dir without state.json: both ignored
    (tmp_path / ".step-00000009.tmp-1").mkdir()
    (tmp_path / "step-00000010").mkdir()
    state, path = cm.latest()
    assert state.step == 3 and state.offsets == {0: 30, 1: 5} and state.processed == [[0, 31, "a"], [1, 5, "b"]]
    assert torch.equal(CheckpointManager.load_trainer_state(path)["model"]["w"], torch.ones(2) * 3)
    assert sorted(p.name for p in tmp_path.glob("step-*") if (p / "state.json").exists()) == ["step-00000002", "step-00000003"]


def test_staged_version_survives_pruning_and_is_what_gets_verified(tmp_path):
    import shutil as _shutil

    from rlstream.common.weights.store import stage_version

    ws = WeightStore(tmp_path / "w", keep=1)
    a = ws.write(1, {"w": torch.arange(16.0)}, tmp_path)
    staged = stage_version(a["uri"], tmp_path / "stage")
    ws.write(2, {"w": torch.zeros(16)}, tmp_path)  # prunes version 1 under the reader
    assert not ws.path(1).exists()
    assert verify(staged.as_uri(), a["sha256"], a["bytes"]) == staged
    _shutil.rmtree(ws.path(2))
    with pytest.raises(WeightStoreError, match="vanished"):
        stage_version(ws.root.joinpath("v00000002").resolve().as_uri(), tmp_path / "stage2")
