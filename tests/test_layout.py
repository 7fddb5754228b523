"""The package's imports run one way: no module of ``applier`` imports, directly or through others, itself.

Every ``import`` and ``from … import`` of an ``applier`` module counts, at the top of a module or
inside a function alike (a function-local import only hides a cycle until the function runs), in the
Python modules and in the Cython ones (``*.pyx``: their ``import``, ``cimport`` and ``from … (c)import``
lines, read as text). Importing ``a.b.c`` from outside package ``a.b`` runs ``a/b/__init__.py`` first:
that counts as importing ``a.b`` too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import applier

PACKAGE = Path(applier.__file__).resolve().parent


# a Cython import line (indented too: function-local): ``from X cimport a, b`` / ``from X import (a, b`` / ``import X``
PYX_FROM = re.compile(r"^\s*from\s+([\w.]+)\s+c?import\s+\(?([\w\s,]+)", re.MULTILINE)
PYX_IMPORT = re.compile(r"^\s*c?import\s+([\w.]+(?:\s*,\s*[\w.]+)*)", re.MULTILINE)


def imported_names(path: Path) -> list[str]:
    """The dotted names a module's import lines name (``from X import a``: ``X`` and ``X.a``)."""
    names: list[str] = []
    text = path.read_text()
    if path.suffix == ".pyx":
        for module, what in PYX_FROM.findall(text):
            names += [module] + [f"{module}.{a.split()[0]}" for a in what.split(",") if a.strip()]
        for modules in PYX_IMPORT.findall(text):
            names += [m.strip() for m in modules.split(",")]
        return names
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (and the packages whose ``__init__`` that runs)."""
    mods = {}
    for path in [*package.rglob("*.py"), *package.rglob("*.pyx")]:
        parts = path.relative_to(package.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for name in imported_names(path):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                n = ".".join(parts[:i])
                outside = i == len(parts) or not (mod == n or mod.startswith(n + "."))
                if n in mods and n != mod and outside:
                    graph[mod].add(n)
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


def test_the_cycle_finder_reads_cython_imports_and_package_inits(tmp_path: Path) -> None:
    """A function-local import in a ``.pyx`` counts, and so does the ``__init__`` of the package it imports from."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.user import f\n")
    (pkg / "sub" / "user.py").write_text("from pkg.sub import leaf\nfrom pkg import fast\n")
    (pkg / "sub" / "leaf.py").write_text("")
    (pkg / "fast.pyx").write_text("from libc.stdint cimport uint8_t\n\ncdef int bind():\n    from pkg.sub import leaf\n")
    assert cycles(import_graph(pkg)) == [["pkg.fast", "pkg.sub", "pkg.sub.user"]]
