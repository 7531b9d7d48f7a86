"""tests/support/house.py measures small made-up trees as a person would count them, in the
older layout (three top-level packages) and in the namespace one."""
from __future__ import annotations

from pathlib import Path

from tests.support.house import measure


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


OLD = {
    "pyproject.toml": '[tool.setuptools.packages.find]\ninclude = ["producer*", "consumer*", "common*"]\n',
    "common/__init__.py": "",
    "common/config.py": "import os\n\n\nX = 1\n",
    "common/harness/__init__.py": "",
    "common/harness/demo.py": "def run():\n    from consumer.ledger import OUTCOMES, Ledger\n    return OUTCOMES\n",
    "producer/__init__.py": "",
    "producer/a.py": "from producer import b\n",
    "producer/b.py": "def f():\n    from . import a\n    import json\n    return a, json\n",
    "consumer/__init__.py": "",
    "consumer/ledger.py": "from common.config import X\nOUTCOMES = X\n",
    "tests/test_x.py": "def test():\n    pass\n",
}

NEW = {
    "pyproject.toml": '[tool.setuptools.package-dir]\n"rlstream" = "ops"\n"rlstream.common" = "common"\n'
                      '"rlstream.producer" = "producer"\n"rlstream.consumer" = "consumer"\n',
    "ops/__init__.py": "",
    "ops/harness/__init__.py": "",
    "ops/harness/demo.py": "def run():\n    from rlstream.consumer.stream.ledger import OUTCOMES\n    return OUTCOMES\n",
    "common/__init__.py": "",
    "common/config.py": "X = 1\n",
    "common/tasks/__init__.py": "",
    "common/tasks/env.py": "from rlstream.producer.a import Y\n",
    "producer/__init__.py": "",
    "producer/a.py": "from rlstream.common.tasks import env\nY = 2\n",
    "consumer/__init__.py": "",
    "consumer/stream/__init__.py": "",
    "consumer/stream/ledger.py": "from rlstream.common.config import X\nOUTCOMES = X\n",
}


def test_the_figures_of_a_small_tree_in_the_older_layout(tmp_path):
    _write(tmp_path, OLD)
    got = measure(tmp_path)
    assert got["source"] == {"lines": sum(t.count("\n") for r, t in OLD.items() if r.endswith(".py")
                                          and not r.startswith("tests/")), "files": 9}
    assert got["tests"] == {"lines": 2, "files": 1}
    # a relative import in a function closes a circle; the other lazy import names no module of ours
    assert got["circles"] == [["producer.a", "producer.b"]]
    assert got["in_function_imports"]["all"] == 3
    assert got["in_function_imports"]["ours"] == 2  # demo.py's one statement, b.py's `from . import a`
    assert got["imports_into_roles"] == ["common.harness.demo -> consumer.ledger"]
    assert got["upward_imports"] == []  # the harness was tooling inside common/: on top, allowed down
    assert got["packages"]["common"]["rooms"] == {"harness": {"lines": 3, "files": 2}}
    assert got["tooling_share_of_common"] == round(3 / 7, 3)
    assert got["installed_top_level"] == ["common", "consumer", "producer"]


def test_the_figures_of_a_small_tree_in_the_namespace_layout(tmp_path):
    _write(tmp_path, NEW)
    got = measure(tmp_path)
    assert got["installed_top_level"] == ["rlstream"]
    assert got["circles"] == [["rlstream.common.tasks.env", "rlstream.producer.a"]]
    assert got["upward_imports"] == ["rlstream.common.tasks.env -> rlstream.producer.a"]
    assert got["imports_into_roles"] == ["rlstream.common.tasks.env -> rlstream.producer.a"]
    assert got["floors"] == {"runtime": 1, "tasks": 1, "role": 4, "tooling": 3}
    assert got["tooling_share_of_common"] == 0.0
    assert got["packages"]["consumer"]["rooms"] == {"stream": {"lines": 2, "files": 2}}
    assert got["in_function_imports"]["ours"] == 1
