"""Each rule is written once: the environment variables of the settings are read in one module each, and the
reasoning-effort values, the tokenizer's files and the run order of the stage DAG are defined in one module.

Read from the sources with :mod:`ast`, never by importing them, so a docstring or a comment that names a
variable is no reading of it, and neither is a manifest that writes it (``{"name": ..., "value": ...}``).
A reading is ``os.environ.get(key)``, ``os.getenv(key)``, ``os.environ[key]`` or ``key in os.environ``, on
``os.environ`` or on a name bound to an expression over it; ``key`` is followed through string constants,
tuples of them, names bound to them (in the module or imported from another of the project's), loop
variables over them, and the parameters of a function of the module that reads by its argument.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("model", "components", "pipelines", "benchmarks")

ENV_READERS: dict[str, str] = {
    "MLFLOW_TRACKING_URI": "components/settings.py",
    "MLFLOW_REGISTRY_URI": "components/settings.py",
    "AWS_ENDPOINT_URL": "components/settings.py",
    "AWS_ENDPOINT_URL_S3": "components/settings.py",
    "STAR_ELASTIC_CACHE": "model/cache_folder.py",
}
"""Variable -> the one module that reads it (the cache folder is the model layer's: the model keeps a cache)."""

DEFINED_ONCE: dict[str, str] = {
    "ReasoningEffort": "components/serving/request_models.py",
    "tokenizer_files": "model/layout.py",
    "topological": "pipelines/runner.py",
    "tied_head": "model/checkpoint.py",
    "cache_folder": "model/cache_folder.py",
}
"""Top-level name -> the one module that defines it."""

SORT_WORDS = ("topolog", "toposort")
"""Any top-level function named with these is a run order of a DAG, and there is one (``topological``)."""

Sources = dict[str, ast.Module]
"""Repository-relative path -> its parsed module."""
Tables = dict[str, dict[str, set[str]]]
"""Module path -> its top-level names bound to strings (worked out once per module)."""


# ---------------------------------------------------------------------- reading the sources
def parse_sources(root: Path, folders: Iterable[str]) -> Sources:
    """Every ``.py`` under ``folders`` of ``root``, parsed."""
    return {
        str(path.relative_to(root)): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for folder in folders
        for path in sorted((root / folder).rglob("*.py"))
    }


def _module_path(dotted: str, sources: Mapping[str, ast.Module]) -> str | None:
    for candidate in (dotted.replace(".", "/") + ".py", dotted.replace(".", "/") + "/__init__.py"):
        if candidate in sources:
            return candidate
    return None


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


def _scope_nodes(root: ast.AST) -> list[ast.AST]:
    """The nodes of ``root``'s own scope: nested functions appear, their bodies do not (they are scopes too)."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return out


def _local_names(root: ast.AST, nodes: list[ast.AST]) -> set[str]:
    """Names a function binds itself (parameters, assignment and loop targets); none for a module."""
    if not isinstance(root, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return set()
    a = root.args
    params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None}
    return params | {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


@dataclass
class _Scope:
    """A module or function body: its nodes, its names bound to strings and its names bound to the environment
    (a function starts from what its enclosing scope knows)."""

    root: ast.AST
    nodes: list[ast.AST]
    strings: dict[str, set[str]]
    aliases: set[str]

    def eval(self, node: ast.AST | None) -> set[str]:
        """The strings ``node`` may be: constants, tuples and lists of them, names bound to them."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(self.eval(e) for e in node.elts))
        if isinstance(node, ast.Starred):
            return self.eval(node.value)
        if isinstance(node, ast.Name):
            return set(self.strings.get(node.id, ()))
        return set()

    def environ_like(self, node: ast.AST) -> bool:
        return _is_environ(node) or (isinstance(node, ast.Name) and node.id in self.aliases)

    def bind(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.Assign) and any(self.environ_like(n) for n in ast.walk(node.value)):
                self.aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for _ in range(3):  # names bound to names: a few rounds reach the fixed point
            for node in self.nodes:
                pairs: list[tuple[ast.AST, ast.AST | None]] = []
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, ast.AnnAssign):
                    pairs = [(node.target, node.value)]
                elif isinstance(node, ast.For | ast.comprehension):
                    pairs = [(node.target, node.iter)]
                for target, value in pairs:
                    if isinstance(target, ast.Name) and (found := self.eval(value)):
                        self.strings.setdefault(target.id, set()).update(found)

    def readings(self) -> Iterable[tuple[ast.AST, int]]:
        """``(key expression, line)`` of every reading of the environment in this scope."""
        for node in self.nodes:
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                getter = isinstance(func, ast.Attribute) and func.attr == "get" and self.environ_like(func.value)
                if getter or _is_getenv(func):
                    yield node.args[0], node.lineno
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and self.environ_like(node.value):
                yield node.slice, node.lineno
            elif isinstance(node, ast.Compare) and self.in_environ(node):
                yield node.left, node.lineno

    def in_environ(self, node: ast.Compare) -> bool:
        """``key in os.environ`` (or ``not in``)."""
        ops = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
        return ops and any(self.environ_like(c) for c in node.comparators)

    def reads_by_argument(self) -> bool:
        """Whether this function reads the variable an argument names (``def get(*names)``, ``env[n] for n in
        names``)."""
        if not isinstance(self.root, ast.FunctionDef | ast.AsyncFunctionDef):
            return False
        a = self.root.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None}
        loops = {
            n.target.id
            for n in self.nodes
            if isinstance(n, ast.For | ast.comprehension) and isinstance(n.target, ast.Name)
            if isinstance(n.iter, ast.Name) and n.iter.id in params
        }
        return any(isinstance(k, ast.Name) and k.id in params | loops for k, _ in self.readings())


class _Module:
    """One module's scopes and its readings of the environment."""

    def __init__(self, path: str, sources: Sources, tables: Tables, seen: frozenset[str]) -> None:
        self.tree, self.sources, self.tables, self.seen = sources[path], sources, tables, seen | {path}
        self.scopes: list[_Scope] = []
        self._add(self.tree, self._imported(), set())

    def _imported(self) -> dict[str, set[str]]:
        """Names imported from the project's modules that are bound to strings there."""
        out: dict[str, set[str]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                other = _module_path(node.module, self.sources)
                if other is None or other in self.seen:
                    continue
                table = constants_of(other, self.sources, self.tables, self.seen)
                for alias in node.names:
                    if alias.name in table:
                        out.setdefault(alias.asname or alias.name, set()).update(table[alias.name])
        return out

    def _add(self, root: ast.AST, strings: dict[str, set[str]], aliases: set[str]) -> None:
        nodes = _scope_nodes(root)
        local = _local_names(root, nodes)  # a name bound in a function is its own there (Python's scoping)
        inherited = {k: set(v) for k, v in strings.items() if k not in local}
        scope = _Scope(root, nodes, inherited, aliases - local)
        scope.bind()
        self.scopes.append(scope)
        for node in scope.nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                self._add(node, scope.strings, scope.aliases)

    def constants(self) -> dict[str, set[str]]:
        """Names bound at the top level to strings (what another module imports)."""
        top = self.scopes[0]
        return {
            t.id: top.eval(node.value)
            for node in self.tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name) and top.eval(node.value)
        }

    def reads(self) -> dict[str, list[int]]:
        """Variable -> the lines that read it."""
        found: dict[str, set[int]] = {}
        readers = {s.root.name for s in self.scopes if isinstance(s.root, ast.FunctionDef) and s.reads_by_argument()}
        for scope in self.scopes:
            for key, line in scope.readings():
                for name in scope.eval(key):
                    found.setdefault(name, set()).add(line)
            for node in scope.nodes:
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in readers:
                    for name in set().union(*(scope.eval(arg) for arg in node.args)):
                        found.setdefault(name, set()).add(node.lineno)
        return {name: sorted(lines) for name, lines in found.items()}


def constants_of(
    path: str, sources: Sources, tables: Tables, seen: frozenset[str] = frozenset()
) -> dict[str, set[str]]:
    """The top-level names of module ``path`` bound to strings, worked out once (``tables``: those known)."""
    if path not in tables:
        tables[path] = _Module(path, sources, tables, seen).constants()
    return tables[path]


def environment_reads(sources: Sources, names: Iterable[str]) -> dict[str, dict[str, list[int]]]:
    """Variable of ``names`` -> {module that reads it: lines}."""
    wanted = set(names)
    tables: Tables = {}
    out: dict[str, dict[str, list[int]]] = {}
    for path in sources:
        for name, lines in _Module(path, sources, tables, frozenset()).reads().items():
            if name in wanted:
                out.setdefault(name, {})[path] = lines
    return out


def _top_level(body: list[ast.stmt]) -> Iterable[tuple[str, ast.stmt]]:
    """``(name, statement)`` of what a module body defines, through top-level ``if`` and ``try`` blocks."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name, node
        elif isinstance(node, ast.Assign):
            yield from ((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node
        elif isinstance(node, ast.If):
            yield from _top_level([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            yield from _top_level([*node.body, *handlers, *node.orelse, *node.finalbody])


def definitions(sources: Sources) -> dict[str, list[str]]:
    """Top-level name -> the modules that define it (imports are not definitions)."""
    out: dict[str, list[str]] = {}
    for path, tree in sources.items():
        for name in dict(_top_level(tree.body)):
            out.setdefault(name, []).append(path)
    return out


def _literal_values(node: ast.AST | None) -> frozenset[str] | None:
    """The values of ``Literal["a", "b"]``; None for anything else."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"):
        return None
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    values = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return frozenset(values) if len(values) == len(elts) else None


def literal_aliases(sources: Sources) -> dict[frozenset[str], list[str]]:
    """``Literal[...]`` values -> ``path:name`` of each top-level alias naming exactly those values."""
    out: dict[frozenset[str], list[str]] = {}
    for path, tree in sources.items():
        for name, node in _top_level(tree.body):
            values = _literal_values(getattr(node, "value", None))
            if values is not None:
                out.setdefault(values, []).append(f"{path}:{name}")
    return out


# ---------------------------------------------------------------------- the project
@pytest.fixture(scope="module")
def sources() -> Sources:
    return parse_sources(REPO, FOLDERS)


def test_each_variable_is_read_in_its_one_module(sources: Sources) -> None:
    reads = environment_reads(sources, ENV_READERS)
    strays = {
        f"{path}:{lines} reads {name} (read it through {ENV_READERS[name]})"
        for name, where in reads.items()
        for path, lines in where.items()
        if path != ENV_READERS[name]
    }
    assert not strays, "\n".join(sorted(strays))
    unread = sorted(name for name, path in ENV_READERS.items() if path not in reads.get(name, {}))
    assert not unread, f"no longer read where this test expects them: {unread}"


def test_each_rule_is_defined_once(sources: Sources) -> None:
    defined = definitions(sources)
    wrong = {name: defined.get(name, []) for name, path in DEFINED_ONCE.items() if defined.get(name) != [path]}
    assert not wrong, f"expected one definition each ({DEFINED_ONCE}), found {wrong}"


def test_one_run_order_of_the_stage_dag(sources: Sources) -> None:
    sorts = sorted(
        f"{path}:{name}"
        for name, paths in definitions(sources).items()
        if any(word in name.lower() for word in SORT_WORDS)
        for path in paths
    )
    assert sorts == [f"{DEFINED_ONCE['topological']}:topological"], sorts
    graphlib = sorted(
        path
        for path, tree in sources.items()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Import) and any(a.name == "graphlib" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "graphlib")
    )
    assert not graphlib, f"a second topological sort (graphlib): {graphlib}"


def test_the_reasoning_effort_values_are_named_once(sources: Sources) -> None:
    path = DEFINED_ONCE["ReasoningEffort"]
    node = dict(_top_level(sources[path].body))["ReasoningEffort"]
    values = _literal_values(getattr(node, "value", None))
    assert values is not None and literal_aliases(sources)[values] == [f"{path}:ReasoningEffort"]


# ---------------------------------------------------------------------- the checks themselves
def _parse(files: Mapping[str, str]) -> Sources:
    return {path: ast.parse(text, path) for path, text in files.items()}


def test_every_way_of_reading_is_seen_and_writing_is_not() -> None:
    files = {
        "components/names.py": 'TRACKING = "MLFLOW_TRACKING_URI"\nBOTH = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")\n',
        "components/reads.py": (
            '"""Reads STAR_ELASTIC_CACHE? Only in words."""\n'
            "import os\n"
            "from os import environ, getenv\n"
            "from components.names import BOTH, TRACKING\n"
            'CACHE = "STAR_ELASTIC_CACHE"\n'
            "a = os.environ.get(TRACKING)\n"  # line 6
            "b = getenv(CACHE)\n"  # 7
            'c = environ["MLFLOW_REGISTRY_URI"]\n'  # 8
            "d = [n for n in BOTH if n in os.environ]\n"  # 9
            "env = dict(os.environ)\n"
            'e = env.get("STAR_ELASTIC_CACHE")\n'  # 11
            "def get(*names):\n"
            "    return next((os.environ[n] for n in names if n), None)\n"
            'f = get("MLFLOW_TRACKING_URI")\n'  # 14
        ),
        "pipelines/manifest.py": (
            "import os\n"
            'env = [{"name": "MLFLOW_TRACKING_URI", "value": "x"}, {"name": "AWS_ENDPOINT_URL", "value": "y"}]\n'
            'os.environ["STAR_ELASTIC_CACHE"] = "/tmp"\n'
            'RESERVED = ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL")\n'
            'os.environ.get("HOME")\n'
        ),
    }
    reads = environment_reads(_parse(files), ENV_READERS)
    assert reads == {
        "MLFLOW_TRACKING_URI": {"components/reads.py": [6, 14]},
        "STAR_ELASTIC_CACHE": {"components/reads.py": [7, 11]},
        "MLFLOW_REGISTRY_URI": {"components/reads.py": [8]},
        "AWS_ENDPOINT_URL_S3": {"components/reads.py": [9]},
        "AWS_ENDPOINT_URL": {"components/reads.py": [9]},
    }


def test_second_definitions_are_found() -> None:
    sources = _parse(
        {
            "model/a.py": 'from typing import Literal\nEffort = Literal["low", "high"]\ndef topological(s): ...\n',
            "components/b.py": (
                "from typing import Literal\nfrom model.a import topological\n"
                'if True:\n    Level = Literal["high", "low"]\n'
                "try:\n    def toposort_stages(s): ...\nexcept ImportError:\n    pass\n"
            ),
        }
    )
    defined = definitions(sources)
    assert defined["topological"] == ["model/a.py"]  # an import is no definition
    assert defined["toposort_stages"] == ["components/b.py"]
    assert literal_aliases(sources)[frozenset({"low", "high"})] == ["model/a.py:Effort", "components/b.py:Level"]
