"""A harness run (demo, experiments) gets an admin token when none is set, so its control
records are signed: without one every service refuses them, and the `max_staleness: auto`
controller of a stability arm could never move the bound (it stayed at `auto.start`)."""
from __future__ import annotations

import stat

from rlstream.common.config import RlstreamConfig
from rlstream.harness.runs import ADMIN_TOKEN_FILE, RunDirs, run_admin_env
from rlstream.harness.supervisor import Pipeline, Service


def test_a_run_without_a_token_gets_one_in_its_services_environment_and_a_0600_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSTREAM_ADMIN_TOKEN", raising=False)
    env = run_admin_env(RlstreamConfig(), RunDirs(tmp_path))
    token = env["RLSTREAM_ADMIN_TOKEN"]
    assert len(token) >= 24
    path = tmp_path / ADMIN_TOKEN_FILE
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    (tmp_path / "other").mkdir()
    assert run_admin_env(RlstreamConfig(), RunDirs(tmp_path / "other")) != env  # one per run


def test_a_token_already_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSTREAM_ADMIN_TOKEN", "operator-token")
    assert run_admin_env(RlstreamConfig(), RunDirs(tmp_path)) == {}
    monkeypatch.delenv("RLSTREAM_ADMIN_TOKEN")
    cfg = RlstreamConfig.model_validate({"cli": {"admin_token": "t"}, "consumer": {"http": {"admin_token": "t"}},
                                         "producer": {"http": {"admin_token": "t"}}})
    assert run_admin_env(cfg, RunDirs(tmp_path)) == {}
    assert not (tmp_path / ADMIN_TOKEN_FILE).exists()


def test_every_service_of_a_pipeline_gets_the_runs_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(Service, "start", lambda self: self)
    pipe = Pipeline(RlstreamConfig(), tmp_path / "config.yaml", tmp_path, env={"RLSTREAM_ADMIN_TOKEN": "run"})
    consumer = pipe._start("consumer", [], threads=1)
    producer = pipe._start("producer", [], threads=1, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert consumer.env["RLSTREAM_ADMIN_TOKEN"] == producer.env["RLSTREAM_ADMIN_TOKEN"] == "run"
    assert producer.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and consumer.env["OMP_NUM_THREADS"] == "1"
