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
import tomllib
from pathlib import Path

import applier
from applier.decoder.messages import MessageKind

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


# -- the wire format's message kinds are spelled in the decoder only ---------------------------------------------

DECODER = PACKAGE / "decoder"
KIND_LETTERS = frozenset(chr(k) for k in MessageKind)
# The compiled twin of the decoder's fast path (decoder/pgoutput.py, decoder/framing.py) is the decoder, compiled:
# its kind bytes are C integers (0x49 …) that mirror MessageKind, and tests/decoder/test_twins.py runs both paths
# on every kind. (It also compares TupleData's column kinds and COPY's escapes, letters the kinds share.)
DECODER_TWINS = {PACKAGE / "_rowpath.pyx"}
_PYX_SPELLINGS = re.compile(
    r"""(?x)
    \bb(?P<q>["'])(?P<one>[^"'\\])(?P=q)             # b"C"
    | \bord\(\s*(?P<q2>["'])(?P<ord>.)(?P=q2)\s*\)   # ord("C")
    | \b(?:frozen)?set\(\s*b(?P<q3>["'])(?P<set>[^"']+)(?P=q3)\s*\)   # frozenset(b"CKr")
    | (?:==|!=|\bin)\s*(?P<hex>0[xX][0-9a-fA-F]{2})\b   # == 0x43
    | \b(?P<hex2>0[xX][0-9a-fA-F]{2})\s*(?:==|!=)       # 0x43 ==
    """)


def _kind_literal(node: ast.AST) -> bool:
    """A bytes literal made only of message-kind letters (b"C", b"BbS")."""
    return (isinstance(node, ast.Constant) and isinstance(node.value, bytes) and node.value != b""
            and all(chr(c) in KIND_LETTERS for c in node.value))


def kind_spellings_py(path: Path, root: Path) -> list[str]:
    """Where a Python module spells a message kind's byte: a kinds-only bytes literal compared with or held in a
    container, ``(frozen)set(b"…")`` of kind letters, ``ord("X")`` of one, or a hex integer of one compared."""
    text = path.read_text()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        literals: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                literals += [side, *(side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [])]
                if isinstance(side, ast.Constant) and isinstance(side.value, int) and not isinstance(side.value, bool):
                    spelled = ast.get_source_segment(text, side) or ""
                    if spelled.lower().startswith("0x") and chr(side.value) in KIND_LETTERS:
                        found.append((side.lineno, spelled))
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            literals += node.elts
        elif isinstance(node, ast.Dict):
            literals += [k for k in node.keys if k is not None] + node.values
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            arg = node.args[0]
            if node.func.id in ("frozenset", "set"):
                literals.append(arg)
            elif (node.func.id == "ord" and isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                  and arg.value in KIND_LETTERS):
                found.append((node.lineno, f"ord({arg.value!r})"))
        found += [(n.lineno, repr(n.value)) for n in literals if _kind_literal(n)]  # type: ignore[attr-defined]
    return [f"{path.relative_to(root)}:{line}: {what}" for line, what in sorted(set(found))]


def kind_spellings_pyx(path: Path, root: Path) -> list[str]:
    """The same for a Cython module, read as text (outside comments and docstrings' ``…`` quotes alike)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        for m in _PYX_SPELLINGS.finditer(code):
            letters = m.group("one") or m.group("ord") or m.group("set") or ""
            hexa = m.group("hex") or m.group("hex2")
            if hexa is not None:
                if chr(int(hexa, 16)) not in KIND_LETTERS:
                    continue
            elif not letters or any(c not in KIND_LETTERS for c in letters):
                continue
            out.append(f"{path.relative_to(root)}:{n}: {m.group(0).strip()}")
    return out


def kind_spellings(package: Path, decoder: Path) -> list[str]:
    """Every spelling of a message kind's byte in ``package`` outside ``decoder`` and its compiled twin."""
    out: list[str] = []
    for path in sorted(package.rglob("*.py")) + sorted(package.rglob("*.pyx")):
        if decoder in path.parents or path in DECODER_TWINS:
            continue
        read = kind_spellings_py if path.suffix == ".py" else kind_spellings_pyx
        out += read(path, package.parent)
    return out


def test_only_the_decoder_spells_a_message_kind() -> None:
    # every other module asks applier.decoder.messages (MessageKind and the boundary rules on it); the benchmarks too
    assert kind_spellings(PACKAGE, DECODER) == []
    assert kind_spellings(PACKAGE.parent / "bench", DECODER) == []


def test_the_kind_finder_finds_each_spelling(tmp_path: Path) -> None:
    pkg = tmp_path / "applier"
    (pkg / "decoder").mkdir(parents=True)
    (pkg / "decoder" / "kinds.py").write_text('BEGIN = ord("B")\n')
    (pkg / "a.py").write_text('ENDS = frozenset(b"CKr")\nif p[:1] in (b"C", b"x"): pass\n'
                              'if k == 0x43 or 0x42 == k or k == 0x77: pass\nX = {b"B": b"C"}\nY = ord("S")\n'
                              'Z = b"t" * 3\nW = ord("w")\n')
    (pkg / "b.pyx").write_text('cdef int C = ord("C")\nif kind == 0x4B:  # == 0x4F\n    pass\n'
                               'if s == b"t": pass\nS = set(b"BS")\n')
    found = kind_spellings(pkg, pkg / "decoder")
    assert [f.split(": ", 1)[1] for f in found] == [
        "b'CKr'", "b'C'", "0x42", "0x43", "b'B'", "b'C'", "ord('S')",  # a.py, by line
        'ord("C")', "== 0x4B", 'set(b"BS")']


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


# Where a kind of target may be named as a ``Kind`` member: the targets package (each kind's folder, the registry of
# Backends) and the registry of URL schemes. Elsewhere a question about the target goes to its Backend.
KIND_CHOSEN = ("targets/", "url.py")


def kind_choices(package: Path) -> list[str]:
    """``path:line: Kind.X`` of every ``Kind`` member named outside ``KIND_CHOSEN``: compared with, a table's key, or
    handed on (``backend(Kind.SQLITE)``), each a choice by kind."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(KIND_CHOSEN):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Kind"
                    and node.attr.isupper()):
                found.append(f"{rel}:{node.lineno}: Kind.{node.attr}")
    return sorted(set(found))


def test_no_code_outside_the_targets_chooses_by_kind() -> None:
    # `if kind is Kind.SQLITE` or `{Kind.POSTGRESQL: …}` outside applier/targets/ is a kind's code in the wrong
    # room: a third kind would need it found and extended; make it a method of the kind's Backend
    assert kind_choices(PACKAGE) == []


def test_the_kind_choice_check_finds_each_choice(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "targets" / "sqlite").mkdir(parents=True)
    (pkg / "a.py").write_text("def f(k):\n    return k is Kind.SQLITE\nT = {Kind.POSTGRESQL: 1}\nb = backend(Kind.SQLITE)\n"
                              "def g(kind: Kind) -> Kind:\n    return Kind(kind)\n")
    (pkg / "targets" / "sqlite" / "b.py").write_text("ok = k is Kind.SQLITE\n")
    (pkg / "url.py").write_text("S = {'sqlite': Kind.SQLITE}\n")
    assert kind_choices(pkg) == ["a.py:2: Kind.SQLITE", "a.py:3: Kind.POSTGRESQL", "a.py:4: Kind.SQLITE"]


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


# -- the sandbox (throwaway clusters, the demo) sits beside the core ---------------------------------------------

CORE = ("applier.decoder", "applier.source", "applier.engine", "applier.targets", "applier.migrate",
        "applier.progress")


def test_the_core_never_imports_the_sandbox() -> None:
    # only the `applier demo` command (the CLI) reaches applier.sandbox; replication never starts a server
    graph = import_graph(PACKAGE)
    found = sorted(f"{mod} imports {dep}" for mod, deps in graph.items() if mod.startswith(CORE)
                   for dep in deps if dep.startswith("applier.sandbox"))
    assert found == []
    assert any(dep.startswith("applier.sandbox") for dep in graph["applier.cli.engine_commands"])  # the check sees


def test_every_package_folder_is_packaged() -> None:
    """A folder of applier with an ``__init__.py`` that pyproject's package list lacks is left out of a wheel (and out
    of an editable install's finder): its imports work from a checkout and fail where users install."""
    root = Path(applier.__file__).resolve().parent
    listed = set(tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("applier", *p.parent.relative_to(root).parts)) for p in root.rglob("__init__.py")}
    assert sorted(folders - listed) == []
