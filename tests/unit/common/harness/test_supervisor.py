"""ops/harness/supervisor.py: incarnations, run-file status, graceful stop and kill.

The child is a stand-in for `rlstream producer|consumer` that follows the run
file contract of common/runfile.py (start record once it "serves", stop
record on SIGTERM); the real services are supervised in the integration tests.
"""
from __future__ import annotations

import signal
import sys

import pytest

from rlstream.common.errors import PipelineError
from rlstream.harness.supervisor import Service, child_env, wait_until

FAKE = """
import signal, sys, time
from rlstream.common import runfile
path, crash = sys.argv[1], sys.argv[2] == "crash"
print("starting", flush=True)
if crash:
    sys.exit(3)
runfile.write_run_file(path, fresh=True, **runfile.started("consumer", "http://127.0.0.1:1", "b:9"))
def stop(*_):
    runfile.write_run_file(path, **runfile.stopped(outcomes={"trained": 8.0}, held=0, step=2))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.05)
"""


class FakeService(Service):
    mode = "serve"

    def argv(self) -> list[str]:
        return [sys.executable, "-c", FAKE, str(self.run_path()), self.mode]


def test_argv_gives_each_incarnation_its_own_run_file_and_log(tmp_path):
    s = Service("consumer", tmp_path / "c.yaml", tmp_path / "logs", sets=["kafka.bootstrap_servers=b:9"])
    s.incarnation = 3
    argv = s.argv()
    assert argv[1:6] == ["-m", "rlstream.cli", "consumer", "-c", str(tmp_path / "c.yaml")]
    assert argv[-4:] == ["--set", "kafka.bootstrap_servers=b:9", "--set",
                         f"consumer.run_file={tmp_path / 'logs' / 'consumer.3.run.json'}"]
    assert s.log_path() == tmp_path / "logs" / "consumer.3.log"
    assert "--set" not in Service("broker", tmp_path / "c.yaml", tmp_path / "logs").argv()


def test_status_url_and_final_counters_come_from_the_run_file(tmp_path):
    with FakeService("consumer", tmp_path / "c.yaml", tmp_path / "logs") as s:
        s.start()
        assert s.wait_ready(60) == "http://127.0.0.1:1"
        assert s.status()["state"] == "running" and s.final() is None
        assert s.stop(60) == 0 and not s.alive
        assert s.final()["outcomes"] == {"trained": 8.0} and s.final()["held"] == 0
        assert s.url == "http://127.0.0.1:1"
        s.start()  # a second incarnation: fresh files, the first one's kept
        s.wait_ready(60)
        assert s.incarnation == 2 and s.final() is None and s.final(1)["step"] == 2
        assert s.kill() == -signal.SIGKILL and s.status()["state"] == "running"  # a crash writes nothing
        assert "starting" in s.log_text(1) and s.log_path(2).exists()


def test_a_service_that_dies_while_waited_for_is_reported_with_its_log(tmp_path):
    s = FakeService("consumer", tmp_path / "c.yaml", tmp_path / "logs")
    s.mode = "crash"
    s.start()
    with pytest.raises(PipelineError, match=r"(?s)consumer exited \(3\) while waiting for consumer to serve.*starting"):
        s.wait_ready(60)
    with pytest.raises(PipelineError, match="timed out after 0 s waiting for nothing"):
        wait_until(lambda: False, 0.1, "nothing")
    assert wait_until(lambda: 42, 1, "an answer") == 42


def test_children_get_explicit_threads_and_no_rlstream_overrides(monkeypatch):
    monkeypatch.setenv("RLSTREAM__CONSUMER__LR", "1")
    env = child_env(2, {"X": "y"})
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1" and env["X"] == "y"
    assert not any(k.startswith("RLSTREAM__") for k in env)
