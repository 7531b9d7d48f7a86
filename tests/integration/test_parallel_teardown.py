"""A process that started torch.distributed through init_parallel (gloo, a world of one) tears
it down before the interpreter finalizes (consumer/train/parallel.py close_parallel). A gloo
group left to finalization can abort a process whose work is done ("terminate called without
an active exception": a trainer bench's child exited 1 that way in CI).

The program registers its own exit handler before init_parallel: exit handlers run last in,
first out, so it runs after init_parallel's and reports what that one left."""
from __future__ import annotations

import sys

import pytest

from tests.support.program import Program

pytestmark = pytest.mark.megatron

PROGRAM = """
import atexit
import torch.distributed as dist
from megatron.core import parallel_state as ps
atexit.register(lambda: print("at exit: distributed", dist.is_initialized(),
                              "megatron", ps.model_parallel_is_initialized(), flush=True))
from rlstream.consumer.train.parallel import init_parallel
init_parallel()
print("up: distributed", dist.is_initialized(), "megatron", ps.model_parallel_is_initialized(), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_gloo_world_is_torn_down_before_the_interpreter_exits(tmp_path):
    with Program([sys.executable, "-c", PROGRAM], tmp_path, name="teardown").start() as p:
        assert p.wait(150) == 0, p.log_tail()
        lines = p.lines()
    assert "up: distributed True megatron True" in lines, lines
    assert "at exit: distributed False megatron False" in lines, lines
