"""The step record a replay follows (consumer/logreplay/): its schema, the lineage, the batch.

Pure logic, no Kafka and no Megatron: audit lines and checkpoints written by
hand, rollouts from tests/support/synthetic.py.
"""
from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from rlstream.common.config import ConsumerSettings, ControlSettings
from rlstream.consumer.checkpoint.files import CheckpointState
from rlstream.consumer.logreplay import ReplayError
from rlstream.consumer.logreplay.lineage import lineage_lines, resume_floors
from rlstream.consumer.logreplay.record import INPUTS_SCHEMA, StepInputs, compared_metrics, settings_digest
from rlstream.consumer.logreplay.run import samples
from tests.support.synthetic import synthetic_group


def _inputs(groups, staleness, control, **over) -> dict:
    rollouts = [r for g in groups for r in g]
    d = {"schema": INPUTS_SCHEMA, "topic": "t", "records": [[0, i] for i in range(len(rollouts))],
         "staleness": staleness, "control": control.model_dump(mode="json"), "dynamic_sampling": False,
         "settings": "x", "world": 1, "metrics": {"loss": 0.5}}
    d.update(over)
    return {"step": 3, "trained": [r.rollout_id for r in rollouts], "inputs": d}


def test_an_unknown_schema_or_a_line_without_inputs_is_refused_with_what_to_do():
    rng = np.random.default_rng(0)
    g = [synthetic_group("a", 2, 0, rng)]
    line = _inputs(g, [0, 0], ControlSettings(), schema=INPUTS_SCHEMA + 1)
    with pytest.raises(ReplayError, match=f"schema {INPUTS_SCHEMA + 1}.*reads schema {INPUTS_SCHEMA} only"):
        StepInputs.parse(line)
    with pytest.raises(ReplayError, match="no step inputs.*--from"):
        StepInputs.parse({"step": 3, "trained": []})
    with pytest.raises(ReplayError, match="inconsistent"):
        StepInputs.parse(_inputs(g, [0], ControlSettings()))
    assert StepInputs.parse(_inputs(g, [0, 0], ControlSettings())).records == [(0, 0), (0, 1)]


def test_the_batch_is_weighted_by_the_recorded_control_settings():
    rng = np.random.default_rng(1)
    groups = [synthetic_group("a", 2, 0, rng), synthetic_group("b", 2, 0, rng)]
    rollouts = [r for g in groups for r in g]
    reweight = ControlSettings(max_staleness=4, mode="reweight", decay=0.5)
    s = StepInputs.parse(_inputs(groups, [1, 2, 3, 3], reweight))
    assert [x.sample_weight for x in samples(s, rollouts)] == [0.5, 0.25, 0.125, 0.125]
    assert [x.staleness for x in samples(s, rollouts)] == [1, 2, 3, 3]  # the signals by staleness
    assert [x.temperature for x in samples(s, rollouts, 1.5)] == [r.temperature * 1.5 for r in rollouts]
    s = StepInputs.parse(_inputs(groups, [1, 2, 3, 3], ControlSettings(max_staleness=4)))
    assert [x.sample_weight for x in samples(s, rollouts)] == [1.0] * 4
    s = StepInputs.parse(_inputs(groups, [1, 2, 3, 3], ControlSettings(max_staleness=2)))
    with pytest.raises(ReplayError, match="group b is dropped_stale under the recorded settings"):
        samples(s, rollouts)


def test_lineage_takes_each_steps_line_from_the_run_that_made_the_model(tmp_path):
    lines = [{"step": 1, "run": "a"}, {"step": 2, "run": "a"}, {"step": 3, "run": "a"},  # a died after 3
             {"step": 3, "run": "b"}, {"step": 4, "run": "b"}]  # b resumed from the checkpoint of 2
    (tmp_path / "trained.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 5, "ru')
    st = CheckpointState(4, 5, {0: 9}, runs=[["a", 0], ["b", 2]])
    got = lineage_lines(tmp_path, st, 0, 4)
    assert {s: e["run"] for s, e in got.items()} == {1: "a", 2: "a", 3: "b", 4: "b"}
    assert list(lineage_lines(tmp_path, st, 2, 3)) == [3]
    with pytest.raises(ReplayError, match="no audit line for steps \\[4\\]"):
        lineage_lines(tmp_path, CheckpointState(4, 4, {}, runs=[["a", 0]]), 0, 4)


def test_resume_floors_are_the_lowest_offsets_of_any_kept_checkpoint(tmp_path):
    for step, offsets in ((4, {0: 10, 1: 7}), (6, {0: 12, 1: 5, 2: 3})):
        d = tmp_path / "c" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps(asdict(CheckpointState(step, step, offsets))))
    (tmp_path / "c" / ".step-00000008.tmp-x").mkdir()  # a checkpoint being written does not count
    assert resume_floors([tmp_path / "c"]) == {0: 10, 1: 5, 2: 0}
    with pytest.raises(ReplayError, match="no committed checkpoint"):
        resume_floors([tmp_path / "none"])


def test_settings_digest_follows_the_trainer_settings_only():
    base = ConsumerSettings()
    assert settings_digest(base) == settings_digest(base.model_copy(update={"checkpoint_dir": "elsewhere"}))
    assert settings_digest(base) != settings_digest(ConsumerSettings(num_minibatches=2))
    assert compared_metrics({"loss": 1.0, "time_total": 3.0, "step_overhead_share": 0.1}) == {"loss": 1.0}


def test_a_start_checkpoint_must_lie_on_the_lineage():
    from rlstream.consumer.logreplay.run import _start_in_lineage

    newest = CheckpointState(8, 9, {}, runs=[["a", 0], ["b", 4]])  # a died after its checkpoint of step 4
    assert _start_in_lineage(CheckpointState(4, 4, {}, runs=[["a", 0]]), newest, "c4") == 4
    assert _start_in_lineage(CheckpointState(6, 7, {}, runs=[["a", 0], ["b", 4]]), newest, "c6") == 6
    with pytest.raises(ReplayError, match="not in the lineage"):  # a's checkpoint of a step it lost
        _start_in_lineage(CheckpointState(6, 6, {}, runs=[["a", 0]]), newest, "c6-dead")
