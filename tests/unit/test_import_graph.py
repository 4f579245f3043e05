"""The package's shape: imports go one way and never in a loop, and no source module grows past 500 lines.

The graph is read from the sources with :mod:`ast`, never by importing them, and counts every import the
interpreter (or a type checker) can follow: top-level, inside functions, under ``if TYPE_CHECKING:``
and in ``try`` blocks alike, since a loop that only closes at run time or only for a type checker still
ties two modules into one. ``from package import name`` is an edge to the submodule ``package.name``
when there is one, else to the package. The layers (README, "Layout"): ``model`` < ``components`` <
``pipelines`` < ``benchmarks``; a module imports its own layer or lower, so ``model`` imports none of the
others and only the benchmarks import ``pipelines``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS: tuple[str, ...] = ("model", "components", "pipelines", "benchmarks")
"""Top-level folders, lowest first: a module may import only from its own folder or one listed before it."""
MAX_LINES = 500

Graph = dict[str, dict[str, int]]
"""module -> {imported module: line of the first import of it}."""


# ---------------------------------------------------------------------- reading the graph
def module_files(root: Path, folders: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``folders`` of ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    out: dict[str, Path] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ``modules`` (None: not the project's)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` in ``module`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> dict[str, int]:
    """The project modules ``module`` imports anywhere in its file -> line of the first such import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, path.name == "__init__.py", node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else _known(base, modules))
        for target in targets:
            if target is not None and target != module:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def import_graph(root: Path, folders: Iterable[str]) -> Graph:
    """Every module under ``folders`` -> the project modules it imports (with the line)."""
    modules = module_files(root, folders)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


# ---------------------------------------------------------------------- loops
def import_loops(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of modules that import each
    other, directly or around a loop), sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return sorted(loops)


def describe_loop(loop: list[str], graph: Graph) -> str:
    """The edges inside one loop, ``a:line -> b``, one per line (what to cut)."""
    members = set(loop)
    edges = [f"  {a}:{line} -> {b}" for a in loop for b, line in sorted(graph[a].items()) if b in members]
    return f"{len(loop)} modules import each other:\n" + "\n".join(edges)


def layer_breaches(graph: Graph, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """``a:line -> b`` for every import of a higher layer than the importer's own (see :data:`LAYERS`)."""
    rank = {name: i for i, name in enumerate(layers)}
    return [
        f"{a}:{line} -> {b}"
        for a, targets in sorted(graph.items())
        for b, line in sorted(targets.items())
        if rank[b.split(".")[0]] > rank[a.split(".")[0]]
    ]


# ---------------------------------------------------------------------- the project
@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(REPO, LAYERS)


def test_no_two_modules_import_each_other(graph: Graph) -> None:
    loops = import_loops(graph)
    assert not loops, "\n".join(describe_loop(loop, graph) for loop in loops)


def test_imports_follow_the_layers(graph: Graph) -> None:
    assert not layer_breaches(graph), "imports of a higher layer:\n" + "\n".join(layer_breaches(graph))


def test_no_source_module_over_500_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in module_files(REPO, LAYERS).values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam): {long}"


# ---------------------------------------------------------------------- the checks themselves
def _write(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_the_graph_sees_deferred_typing_and_relative_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "model/__init__.py": "",
            "model/a.py": "def f():\n    from model.b import g\n",
            "model/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model.c import C\n",
            "model/c.py": "import torch\nfrom . import a\n",
            "model/sub/__init__.py": "from .leaf import x\n",
            "model/sub/leaf.py": "from .. import c\n",
            "components/__init__.py": "",
            "components/x.py": "from model.sub import x\nimport model.a as a\n",
        },
    )
    graph = import_graph(tmp_path, ("model", "components"))
    assert graph["model.a"] == {"model.b": 2}
    assert graph["model.b"] == {"model.c": 3}
    assert graph["model.c"] == {"model.a": 2}  # torch is not the project's
    assert graph["model.sub"] == {"model.sub.leaf": 1}
    assert graph["model.sub.leaf"] == {"model.c": 1}
    assert graph["components.x"] == {"model.sub": 1, "model.a": 2}
    assert import_loops(graph) == [["model.a", "model.b", "model.c"]]
    assert "model.b:3 -> model.c" in describe_loop(["model.a", "model.b", "model.c"], graph)


def test_loops_and_layer_breaches_are_found() -> None:
    graph: Graph = {
        "model.a": {"model.b": 1},
        "model.b": {"model.a": 1, "components.s": 4},
        "components.s": {"model.a": 1},
        "components.t": {"components.u": 2, "pipelines.p": 3},
        "components.u": {"components.t": 1},
        "pipelines.p": {"components.s": 1},
    }
    assert import_loops(graph) == [["components.s", "model.a", "model.b"], ["components.t", "components.u"]]
    assert layer_breaches(graph) == ["components.t:3 -> pipelines.p", "model.b:4 -> components.s"]
    assert import_loops({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
