"""tests/support/house.py measures a small made-up tree as a person would count it."""
from __future__ import annotations

from pathlib import Path

from tests.support.house import measure


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


TREE = {
    "pyproject.toml": '[tool.setuptools.packages.find]\ninclude = ["producer*", "consumer*", "common*"]\n',
    "common/__init__.py": "",
    "common/config.py": "import os\n\n\nX = 1\n",
    "ops/harness/__init__.py": "",
    "ops/harness/demo.py": "def run():\n    from consumer.ledger import OUTCOMES, Ledger\n    return OUTCOMES\n",
    "producer/__init__.py": "",
    "producer/a.py": "from producer import b\n",
    "producer/b.py": "def f():\n    from . import a\n    import json\n    return a, json\n",
    "consumer/__init__.py": "",
    "consumer/stream/ledger.py": "from rlstream.common.config import X\nOUTCOMES = X\n",
    "tests/test_x.py": "def test():\n    pass\n",
}


def test_the_figures_of_a_small_tree(tmp_path):
    _write(tmp_path, TREE)
    got = measure(tmp_path)
    assert got["source"] == {"lines": sum(t.count("\n") for r, t in TREE.items() if r.endswith(".py")
                                          and not r.startswith("tests/")), "files": 9}
    assert got["tests"] == {"lines": 2, "files": 1}
    # a relative import in a function closes a circle; the other lazy import names no module of ours
    assert got["circles"] == [["producer.a", "producer.b"]]
    assert got["in_function_imports"]["all"] == 3
    assert got["in_function_imports"]["ours"] == 2  # demo.py's one statement, b.py's `from . import a`
    # the namespace is dropped: consumer.ledger imports rlstream.common.config, which is no circle and no role
    assert got["imports_into_roles"] == ["rlstream.harness.demo -> consumer.ledger"]
    assert got["packages"]["common"]["rooms"] == {"harness": {"lines": 3, "files": 2}}
    assert got["tooling_share_of_common"] == round(3 / 7, 3)
    assert got["installed_top_level"] == ["common", "consumer", "producer"]


def test_a_mapped_namespace_installs_one_top_level_name(tmp_path):
    _write(tmp_path, {**TREE, "pyproject.toml": '[tool.setuptools.package-dir]\n"rlstream.common" = "common"\n'
                                                '"rlstream.producer" = "producer"\n'})
    assert measure(tmp_path)["installed_top_level"] == ["rlstream"]
