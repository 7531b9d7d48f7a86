"""A test's own program as a harness Service (tests/support/program.py): it runs from the
repository whatever the working directory, with one thread, its output in its log; a wait
notices it died; leaving `with` kills it."""
from __future__ import annotations

import sys

import pytest

from rlstream.common.errors import PipelineError
from rlstream.harness.supervisor import wait_until
from tests.support.program import Program


@pytest.mark.timeout(60)
def test_a_program_imports_the_tests_package_from_anywhere_with_one_thread(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = "import os, sys, tests.support; print(os.environ['OMP_NUM_THREADS']); print('to stderr', file=sys.stderr)"
    p = Program([sys.executable, "-c", code], tmp_path / "logs", name="p").start()
    assert p.wait(30) == 0, p.log_tail()
    assert p.lines() == ["1", "to stderr"]
    assert p.log_path() == tmp_path / "logs" / "p.1.log"


@pytest.mark.timeout(60)
def test_a_wait_notices_a_program_that_died(tmp_path):
    p = Program([sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"], tmp_path, name="dies").start()
    with pytest.raises(PipelineError, match=r"dies exited \(3\)"):
        wait_until(lambda: False, 30, "what never comes", [p])
    assert "bye" in p.log_tail()


@pytest.mark.timeout(60)
def test_leaving_with_kills_the_program(tmp_path):
    with Program([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, name="sleeper").start() as p:
        assert p.alive
    assert not p.alive and p.returncode == -9
