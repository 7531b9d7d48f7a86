"""The shape of the code base, from its own imports: sizes, rooms, floors, circles.

    .venv/bin/python -m tests.support.house [--top 10] [--root DIR]   # one JSON object on stdout

Read from the source alone (nothing is imported or run), the same way before and
after a restructuring, so two commits compare. The folders and the names they are
imported under come from pyproject.toml: `[tool.setuptools.package-dir]` when it maps
folders into one namespace (ops/ -> rlstream, common/ -> rlstream.common, ...), else the
folders' own names (the older layout: common, producer, consumer at the top level).

  source / tests        lines and files of the packages and of tests/
  packages              lines and files per top folder, and per folder one level down
                        ("rooms"); `common_share` of the source's lines, and the share
                        of common/ that is tooling
  largest_modules       the longest files; `modules_over_400` how many pass 400 lines
  functions             how many; the longest; how many pass 50 and 60 lines
  in_function_imports   import statements inside a function body: all of them, those
                        naming our own modules, and the files with the most of the latter
  circles               import cycles between our modules (strongly connected
                        components of the graph of every import: module level,
                        in functions and under TYPE_CHECKING)
  floors                lines per floor (FLOORS); `upward_imports`: every import that
                        goes up a floor or from one role into the other
  imports_into_roles    edges from a module under common/ to one of the roles
  installed_top_level   the top-level names the wheel installs
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = ("runtime", "tasks", "role", "tooling")
"""Lowest first. runtime: what both services run (common/ less its tasks); tasks: the
tasks, environments and verifiers (common/tasks/); role: producer/ or consumer/;
tooling: what no service runs (the CLI, doctor, harness, cluster twin, toy model)."""
OLD_TOOLING = ("common.app", "common.harness", "common.toy", "common.cluster")
"""The tooling's folders in the older layout, where it lived inside common/."""


@dataclass(frozen=True)
class Layout:
    """Which folders hold the source and the dotted name each is imported under."""

    folders: dict[str, str]  # folder -> package name ("common" -> "rlstream.common")

    @classmethod
    def read(cls, root: Path) -> "Layout":
        cfg = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
        mapped = cfg.get("package-dir") or {}
        if mapped:
            return cls({folder: name for name, folder in mapped.items() if name})
        return cls({p: p for p in ("common", "producer", "consumer")})

    def package(self, top: str) -> str:
        """The dotted name of a top folder ("common" -> "rlstream.common" or "common")."""
        return self.folders[top]

    def module_name(self, path: Path, root: Path) -> str:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([self.folders[parts[0]], *parts[1:]])

    def is_ours(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.folders.values())

    def under(self, module: str, top: str) -> bool:
        """The module lives in top folder `top` (the most specific mapping wins)."""
        best = max((p for p in self.folders.values() if module == p or module.startswith(p + ".")),
                   key=len, default=None)
        return best == self.folders.get(top)

    def floor(self, module: str) -> str:
        common = self.folders["common"]
        if self.under(module, "common"):
            if any(module == t or module.startswith(t + ".") for t in OLD_TOOLING):
                return "tooling"
            return "tasks" if module == f"{common}.tasks" or module.startswith(f"{common}.tasks.") else "runtime"
        if self.under(module, "producer") or self.under(module, "consumer"):
            return "role"
        return "tooling"

    def role(self, module: str) -> str | None:
        return next((r for r in ("producer", "consumer") if self.under(module, r)), None)


def upward(layout: Layout, src: str, dst: str) -> bool:
    """An import from `src` to `dst` that goes up a floor, or from one role into the other."""
    a, b = FLOORS.index(layout.floor(src)), FLOORS.index(layout.floor(dst))
    if b > a:
        return True
    return a == b == FLOORS.index("role") and layout.role(src) != layout.role(dst)


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


def imports_of(path: Path, module: str) -> list[tuple[list[str], bool]]:
    """Per import statement of a file: (the dotted names it imports, whether it is in a function)."""
    found = _Imports(module, path.name == "__init__.py")
    found.visit(ast.parse(path.read_text(), str(path)))
    return found.found


def _target(name: str, modules: set[str]) -> str | None:
    """The module of ours an imported name lands in (`a.b.C` -> `a.b`), if any."""
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


def source_files(root: Path, layout: Layout) -> dict[str, Path]:
    """{dotted module name: path} of every source file under the layout's folders."""
    return {layout.module_name(p, root): p for top in layout.folders for p in sorted((root / top).rglob("*.py"))}


def graph_of(root: Path, layout: Layout) -> tuple[dict[str, set[str]], dict[str, list[bool]]]:
    """The import graph of our modules, and per module whether each import of ours is in a function."""
    files = source_files(root, layout)
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    lazy: dict[str, list[bool]] = {m: [] for m in modules}
    for mod, path in files.items():
        for names, in_function in imports_of(path, mod):
            targets = {t for t in (_target(n, modules) for n in names if layout.is_ours(n)) if t not in (None, mod)}
            graph[mod] |= targets
            if targets:
                lazy[mod].append(in_function)
    return graph, lazy


def _rooms(sizes: dict[str, int], layout: Layout, top: str) -> dict:
    pkg = layout.package(top)
    mods = [m for m in sizes if layout.under(m, top)]
    depth = pkg.count(".") + 1
    below = sorted({m.split(".")[depth] for m in mods if m.count(".") > depth})
    flat = [m for m in mods if m.count(".") == depth and m.split(".")[depth] not in below]
    return {"lines": sum(sizes[m] for m in mods), "files": len(mods), "flat_modules": len(flat),
            "flat_lines": sum(sizes[m] for m in flat),
            "rooms": {r: {"lines": sum(n for m, n in sizes.items() if m.startswith(f"{pkg}.{r}.") or m == f"{pkg}.{r}"),
                          "files": sum(1 for m in sizes if m.startswith(f"{pkg}.{r}.") or m == f"{pkg}.{r}")}
                      for r in below}}


def _installed_top_level(root: Path) -> list[str]:
    """What the wheel installs at the top level (pyproject's package-dir or package discovery)."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    if "package-dir" in cfg:
        return sorted({k.split(".")[0] for k in cfg["package-dir"] if k})
    packages = cfg.get("packages", {})
    include = packages.get("find", {}).get("include", []) if isinstance(packages, dict) else packages
    return sorted({pattern.rstrip("*").split(".")[0] for pattern in include})


def measure(root: Path = ROOT, top: int = 10) -> dict:
    layout = Layout.read(root)
    files = source_files(root, layout)
    sizes = {m: _lines(p) for m, p in files.items()}
    graph, lazy = graph_of(root, layout)
    functions, in_function = [], 0
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function += sum(lazy_ for _, lazy_ in imports_of(path, mod))
        functions += [(f"{path.relative_to(root)}:{line} {name}", n) for name, line, n in _functions(tree)]
    lazy_ours = Counter({str(files[m].relative_to(root)): sum(v) for m, v in lazy.items() if sum(v)})
    edges = [(a, b) for a, bs in graph.items() for b in sorted(bs)]
    total = sum(sizes.values())
    common_lines = sum(n for m, n in sizes.items() if layout.under(m, "common"))
    tooling_in_common = sum(n for m, n in sizes.items() if layout.under(m, "common") and layout.floor(m) == "tooling")
    tests = sorted((root / "tests").rglob("*.py"))
    longest = sorted(functions, key=lambda f: -f[1])
    return {
        "source": {"lines": total, "files": len(sizes)},
        "tests": {"lines": sum(_lines(p) for p in tests), "files": len(tests)},
        "packages": {t: _rooms(sizes, layout, t) for t in layout.folders},
        "common_share": round(common_lines / total, 3) if total else None,
        "tooling_share_of_common": round(tooling_in_common / common_lines, 3) if common_lines else None,
        "largest_modules": [[str(files[m].relative_to(root)), n]
                            for m, n in sorted(sizes.items(), key=lambda x: -x[1])[:top]],
        "modules_over_400": sum(n > 400 for n in sizes.values()),
        "functions": {"count": len(functions), "over_50": sum(n > 50 for _, n in functions),
                      "over_60": sum(n > 60 for _, n in functions), "longest": [list(f) for f in longest[:3]]},
        "in_function_imports": {"all": in_function, "ours": sum(lazy_ours.values()),
                                "most": lazy_ours.most_common(top)},
        "circles": _cycles(graph),
        "floors": {f: sum(n for m, n in sizes.items() if layout.floor(m) == f) for f in FLOORS},
        "upward_imports": sorted(f"{a} -> {b}" for a, b in edges if upward(layout, a, b)),
        "imports_into_roles": sorted(f"{a} -> {b}" for a, b in edges
                                     if layout.under(a, "common") and layout.role(b)),
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
