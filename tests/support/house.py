"""The shape of the code base, from its own imports: sizes, rooms, floors, circles.

    .venv/bin/python -m tests.support.house [--top 10]      # one JSON object on stdout

Read from the source alone (nothing is imported or run), the same way before and
after a restructuring, so two commits compare:

  source / tests        lines and files of the three packages and of tests/
  packages              lines and files per package, and per folder one level down
                        ("rooms"); `common_share` of the source's lines, and the
                        share of common/ that is tooling (TOOLING folders)
  largest_modules       the longest files; `modules_over_400` how many pass 400 lines
  functions             how many; the longest; how many pass 50 and 60 lines
  in_function_imports   import statements inside a function body: all of them, those
                        naming our own modules, and the files with the most of the latter
  circles               import cycles between our modules (strongly connected
                        components of the graph of every import: module level,
                        in functions and under TYPE_CHECKING)
  imports_into_roles    edges from a module of common/ to one of producer/ or consumer/
  installed_top_level   the top-level names the wheel installs (pyproject's
                        package discovery)

An import of `rlstream.common.x` counts as `common.x`: the figures do not change
with the namespace the packages are installed under.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "producer", "consumer")
ROLES = ("producer", "consumer")
TOOLING = ("rlstream", "rlstream.harness", "rlstream.toy", "rlstream.cluster")
"""Folders of common/ that no service runs: the CLI, the demo and experiment harness,
the toy world and the cluster twin."""
NAMESPACE = "rlstream."


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _ours(name: str) -> str | None:
    """`name` as our module path (namespace dropped), or None if it is not ours."""
    name = name[len(NAMESPACE):] if name.startswith(NAMESPACE) else name
    return name if name.split(".")[0] in PACKAGES else None


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
    """Every import of a file, each noted with whether it sits inside a function."""

    def __init__(self, module: str, is_package: bool):
        self.module, self.is_package = module, is_package
        self.found: list[tuple[list[str], bool]] = []  # per statement: (names it imports, in a function)
        self._depth = 0

    def _function(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(([a.name for a in node.names], self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(node, self.module, self.is_package)
        if base:
            self.found.append(([f"{base}.{a.name}" for a in node.names], self._depth > 0))


def _target(name: str, modules: set[str]) -> str | None:
    """The module of ours an imported name lands in (`a.b.C` -> `a.b`), if any."""
    name = _ours(name)
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, node.lineno, node.end_lineno - node.lineno + 1))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (networkx, which torch installs)."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(graph)
    g.add_edges_from((a, b) for a, bs in graph.items() for b in bs)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _installed_top_level(root: Path) -> list[str]:
    """What setuptools' package discovery in pyproject.toml installs at the top level."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    if "package-dir" in cfg:
        return sorted({k.split(".")[0] for k in cfg["package-dir"] if k})
    include = cfg.get("packages", {}).get("find", {}).get("include", [])
    return sorted({pattern.rstrip("*").split(".")[0] for pattern in include})


def measure(root: Path = ROOT, top: int = 10) -> dict:
    files = {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}
    modules = set(files)
    sizes = {m: _lines(p) for m, p in files.items()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    in_function, in_function_ours, into_roles = 0, Counter(), []
    functions = []
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        found = _Imports(mod, path.name == "__init__.py")
        found.visit(tree)
        for names, lazy in found.found:  # one import statement
            targets = {t for t in (_target(n, modules) for n in names) if t not in (None, mod)}
            in_function += lazy
            in_function_ours[str(path.relative_to(root))] += lazy and bool(targets)
            graph[mod] |= targets
            if mod.split(".")[0] == "common":
                into_roles += [f"{mod} -> {t}" for t in targets if t.split(".")[0] in ROLES]
        functions += [(f"{path.relative_to(root)}:{line} {name}", n) for name, line, n in _functions(tree)]

    def lines_of(prefix: str) -> int:
        return sum(n for m, n in sizes.items() if m == prefix or m.startswith(prefix + "."))

    def files_of(prefix: str) -> int:
        return sum(1 for m in sizes if m == prefix or m.startswith(prefix + "."))

    rooms = {}
    for pkg in PACKAGES:
        below = sorted({m.split(".")[1] for m in modules if m.count(".") >= 2 and m.startswith(pkg + ".")})
        flat = [m for m in modules if m.startswith(pkg + ".") and m.count(".") == 1 and m.split(".")[1] not in below]
        rooms[pkg] = {"lines": lines_of(pkg), "files": files_of(pkg), "flat_modules": len(flat),
                      "flat_lines": sum(sizes[m] for m in flat),
                      "rooms": {r: {"lines": lines_of(f"{pkg}.{r}"), "files": files_of(f"{pkg}.{r}")} for r in below}}
    total = sum(sizes.values())
    tests = sorted((root / "tests").rglob("*.py"))
    longest = sorted(functions, key=lambda f: -f[1])
    return {
        "source": {"lines": total, "files": len(sizes)},
        "tests": {"lines": sum(_lines(p) for p in tests), "files": len(tests)},
        "packages": rooms,
        "common_share": round(lines_of("common") / total, 3) if total else None,
        "tooling_share_of_common": round(sum(lines_of(t) for t in TOOLING) / lines_of("common"), 3)
        if lines_of("common") else None,
        "largest_modules": [[str(files[m].relative_to(root)), n]
                            for m, n in sorted(sizes.items(), key=lambda x: -x[1])[:top]],
        "modules_over_400": sum(n > 400 for n in sizes.values()),
        "functions": {"count": len(functions), "over_50": sum(n > 50 for _, n in functions),
                      "over_60": sum(n > 60 for _, n in functions), "longest": [list(f) for f in longest[:3]]},
        "in_function_imports": {"all": in_function, "ours": sum(in_function_ours.values()),
                                "most": in_function_ours.most_common(top)},
        "circles": _cycles(graph),
        "imports_into_roles": sorted(set(into_roles)),
        "installed_top_level": _installed_top_level(root),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=10, help="how many of the largest modules and import-heavy files")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.root, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
