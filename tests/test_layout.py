"""The package's imports run one way: no module of ``applier`` imports, directly or through others, itself.

Every ``import`` and ``from … import`` of an ``applier`` module counts, at the top of a module or
inside a function alike (a function-local import only hides a cycle until the function runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import applier

PACKAGE = Path(applier.__file__).resolve().parent


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    mods = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            graph[mod] |= {n for n in names if n in mods and n != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_applier() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


# -- target kinds: told apart by their Backend, never by name ---------------------------------------

KIND_NAMES = frozenset({"sqlite", "postgresql", "postgres"})
# Where a target kind may be compared by name: each kind's own folder, and the registry of URL schemes (url.py).
# Only comparisons count: embedded.py's "postgres" (the server's program and superuser) and text.py's list of
# libpq's URI schemes name no target kind and compare none.
KIND_SPELLED = ("targets/postgres/", "targets/sqlite/", "url.py")


def _kind_literals(node: ast.AST) -> list[str]:
    """The target kind names ``node`` spells as a constant (a string, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KIND_NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _kind_literals(e)]
    return []


def kind_comparisons(package: Path) -> list[str]:
    """``path:line: name`` of every comparison (``==``, ``!=``, ``in``, …) with a target kind's name outside the
    places that may spell one (``KIND_SPELLED``)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(KIND_SPELLED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [n for side in [node.left, *node.comparators] for n in _kind_literals(side)]
                found += [f"{rel}:{node.lineno}: {n!r}" for n in names]
    return found


def test_no_target_kind_is_compared_by_name_outside_its_folder() -> None:
    # a kind compared by name (`!= "sqlite"` meaning PostgreSQL) sends a new kind down another kind's branch: ask
    # the kind's Backend (applier.targets.backend) instead
    assert kind_comparisons(PACKAGE) == []


def test_the_kind_check_finds_a_comparison(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "targets" / "sqlite").mkdir(parents=True)
    (pkg / "a.py").write_text("def f(d):\n    return d != 'sqlite' or d in ('postgresql', 'x')\n")
    (pkg / "targets" / "sqlite" / "b.py").write_text("K = 'sqlite'\nok = K == 'sqlite'\n")
    (pkg / "c.py").write_text("URL = 'sqlite:///x.db'\nok = URL == 'sqlite:///x.db'\n")
    assert kind_comparisons(pkg) == ["a.py:2: 'sqlite'", "a.py:2: 'postgresql'"]
