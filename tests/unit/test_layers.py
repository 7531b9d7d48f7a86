"""The package layering, checked by walking every import (lazy ones included).

    producer/  consumer/       roles: never import each other, never the toy
                               world, the harness or the composition root
    common/ (runtime)          shared by both roles: imports neither role, nor
                               rlstream / rlstream.toy / rlstream.harness
    common/toy/                the self-contained tiny model and task
    ops/harness/            runs services as processes and measures them
    common/app/                the composition root (the `rlstream` command):
                               the one place in common/ that names the roles

`producer/__main__.py` and `consumer/__main__.py` are entry shims that call the
composition root (`python -m rlstream producer` == `rlstream producer`); they are the
only exceptions.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OFF_RUNTIME = ("rlstream", "rlstream.toy", "rlstream.harness")
FORBIDDEN = {
    # package -> imports it must never make
    "producer": ("consumer",) + OFF_RUNTIME,
    "consumer": ("producer",) + OFF_RUNTIME,
    "common": ("producer", "consumer") + OFF_RUNTIME,
    "rlstream.toy": ("rlstream", "rlstream.harness", "consumer"),
}
ENTRY_SHIMS = {"producer.__main__", "consumer.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def layer_of(module: str) -> str:
    """The most specific FORBIDDEN key the module belongs to."""
    for key in sorted(FORBIDDEN, key=len, reverse=True):
        if module == key or module.startswith(key + "."):
            if key == "common" and module.startswith(OFF_RUNTIME):
                return "off-runtime"
            return key
    return "other"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    bad = []
    for pkg in ("producer", "consumer", "common"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = module_name(path)
            layer = layer_of(mod)
            if mod in ENTRY_SHIMS or layer not in FORBIDDEN:
                continue
            for name in imports(path):
                hit = [f for f in FORBIDDEN[layer] if _within(name, f)]
                if hit:
                    bad.append(f"{mod} imports {name} (layer {layer!r} must not import {hit[0]})")
    return bad


def test_layers_hold():
    assert violations() == []


@pytest.mark.parametrize("module, imported", [
    ("producer.engine", "consumer.trainer"),
    ("consumer.service", "rlstream.harness.demo"),
    ("rlstream.common.kafka.reader", "rlstream.common.tasks.arithmetic"),
    ("rlstream.common.config", "producer.service"),
])
def test_checker_catches_a_violation(tmp_path, monkeypatch, module, imported):
    """The walker would catch each forbidden edge (it can fail)."""
    layer = layer_of(module)
    assert layer in FORBIDDEN
    assert any(_within(imported, f) for f in FORBIDDEN[layer])
    src = tmp_path / "m.py"
    src.write_text(f"def f():\n    from {imported} import x\n")
    assert imported in imports(src)


def test_test_files_have_unique_names():
    """The test folders are not packages: pytest imports each test file by its basename
    (rootdir-relative "rootdir/conftest" mode), so two files of one name stop the whole
    collection ("import file mismatch")."""
    from collections import Counter

    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
