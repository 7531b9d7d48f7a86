"""Session-wide fixtures shared by every test area.

Expensive things are built once per session: the tiny model directory here;
the broker, the vLLM engine and the trainer fixtures in the tests/fixtures/
plugins below (one module per area, so areas do not edit each other's files).
Test helpers are imported as a package: `from tests.support.audit import ...`
(tests/ is a package, so pytest puts the repository root on sys.path).
"""
from __future__ import annotations

import os

import pytest

# 2 cores: keep torch/OpenMP from oversubscribing when engine, trainer and
# broker share the machine. Tests that need more set it on purpose.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = ["tests.fixtures.kafka", "tests.fixtures.trainer", "tests.fixtures.producer", "tests.fixtures.load"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """HF-format tiny Qwen3-MoE (random, seeded) + char tokenizer, built once."""
    from rlstream.toy.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
