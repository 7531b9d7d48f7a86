"""The floors of the house, checked by walking every import (lazy ones and TYPE_CHECKING ones
included), with no exemption:

    tooling   rlstream (ops/): cli, doctor, blobs, harness/, cluster/, toy/    may import anything
    role      rlstream.producer (producer/), rlstream.consumer (consumer/)     never each other
    tasks     rlstream.common.tasks (common/tasks/)                            tasks, envs, verifiers
    runtime   rlstream.common (common/, less tasks/)                           what both services run

A module imports only its own floor and the floors below it (tests/support/house.py `upward`),
and the import graph has no circle.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.support.house import Layout, graph_of, measure, source_files, upward

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout.read(ROOT)


def violations() -> list[str]:
    graph, _ = graph_of(ROOT, LAYOUT)
    return sorted(f"{a} ({LAYOUT.floor(a)}) imports {b} ({LAYOUT.floor(b)})"
                  for a, bs in graph.items() for b in bs if upward(LAYOUT, a, b))


def test_every_import_goes_down_or_stays_on_its_floor():
    assert violations() == []


def test_the_import_graph_has_no_circle():
    assert measure(ROOT)["circles"] == []


@pytest.mark.parametrize("module, floor", [
    ("rlstream.common.kafka.reader", "runtime"), ("rlstream.common.tasks.verifiers", "tasks"),
    ("rlstream.producer.engine", "role"), ("rlstream.consumer.stream.ledger", "role"),
    ("rlstream.harness.demo", "tooling"), ("rlstream.cli", "tooling"), ("rlstream", "tooling"),
])
def test_each_package_has_its_floor(module, floor):
    assert LAYOUT.floor(module) == floor


@pytest.mark.parametrize("src, dst, back", [
    ("rlstream.producer.engine", "rlstream.consumer.train.trainer", True),     # a role into the other role
    ("rlstream.consumer.service", "rlstream.harness.demo", False),             # a role into the tooling
    ("rlstream.common.kafka.reader", "rlstream.common.tasks.arithmetic", False),  # the runtime into the tasks
    ("rlstream.common.config", "rlstream.producer.service", False),            # the runtime into a role
    ("rlstream.common.tasks.envs", "rlstream.producer.rollout", False),        # the tasks into a role
])
def test_the_rule_catches_an_import_up(src, dst, back):
    """Each import is refused; the same edge the other way round is allowed, except between roles."""
    assert upward(LAYOUT, src, dst)
    assert upward(LAYOUT, dst, src) is back


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path):
    """A made-up tree whose only upward imports sit in a function and under TYPE_CHECKING."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"rlstream" = "ops"\n"rlstream.common" = "common"\n'
        '"rlstream.producer" = "producer"\n"rlstream.consumer" = "consumer"\n')
    for folder in ("ops", "common", "producer", "consumer"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "producer" / "a.py").write_text("def f():\n    from rlstream.consumer.b import x\n")
    (tmp_path / "consumer" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlstream.cli import main\nx = 1\n")
    (tmp_path / "ops" / "cli.py").write_text("main = 1\n")
    layout = Layout.read(tmp_path)
    graph, lazy = graph_of(tmp_path, layout)
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if upward(layout, a, b))
    assert up == ["rlstream.consumer.b -> rlstream.cli", "rlstream.producer.a -> rlstream.consumer.b"]
    assert lazy["rlstream.producer.a"] == [True]


def test_the_wheel_installs_one_namespace_with_every_package_folder():
    """pyproject.toml lists the packages (setuptools cannot discover mapped folders): every
    folder with an __init__.py is listed, under rlstream, and nothing else is."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(folder) for name, folder in cfg["package-dir"].items()}
    assert set(folders) == {"rlstream", "rlstream.common", "rlstream.producer", "rlstream.consumer"}
    on_disk = {LAYOUT.module_name(init, ROOT) for top in LAYOUT.folders for init in (ROOT / top).rglob("__init__.py")}
    assert sorted(cfg["packages"]) == sorted(on_disk)
    assert all(p == "rlstream" or p.startswith("rlstream.") for p in cfg["packages"])


def lazy_imports_of_ours() -> list[tuple[str, int, str]]:
    """(file, line, source line) of every import of our modules inside a function body."""
    out = []
    for module, path in source_files(ROOT, LAYOUT).items():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                if any(LAYOUT.is_ours(n) for n in names):
                    out.append((str(path.relative_to(ROOT)), node.lineno, lines[node.end_lineno - 1]))
    return sorted(set(out))


def test_an_import_of_ours_inside_a_function_says_what_heavy_dependency_it_defers():
    """Imports of our own modules sit at module level (the floors and the absence of circles make
    that safe), except where one defers a heavy dependency (torch, vLLM, Megatron, uvicorn,
    pyarrow) from a module that does not need it yet; each of those says so (`# defers ...`)."""
    lazy = lazy_imports_of_ours()
    assert [f"{f}:{n}: {line.strip()}" for f, n, line in lazy if "# defers " not in line] == []
    assert len(lazy) <= 30, len(lazy)


def test_test_files_have_unique_names():
    """The test folders are not packages: pytest imports each test file by its basename
    (rootdir-relative "rootdir/conftest" mode), so two files of one name stop the whole
    collection ("import file mismatch")."""
    from collections import Counter

    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_no_file_under_tests_imports_a_test_file():
    """Helpers that several files share live in tests/support/ (or tests/fixtures/). A test file
    imported by another runs twice under two names (pytest's by basename, the importer's
    dotted), with its module-level state and fixtures twice."""
    imported = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            imported += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                         if n.rsplit(".", 1)[-1].startswith("test_")]
    assert imported == []
