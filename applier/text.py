"""Text every layer writes the same way: SQL identifiers and literals, one-line messages, sizes.

Quoting follows PostgreSQL's rules, which SQLite shares for identifiers; replication commands
(simple query protocol, no parameters) use the same.
"""

from __future__ import annotations

import re


def quote_ident(name: str) -> str:
    """Quote an identifier (same rule for PostgreSQL, SQLite and replication commands)."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """Quote a string literal for a replication command."""
    return "'" + value.replace("'", "''") + "'"


def file_safe(name: str) -> str:
    """``name`` as a file name part: anything but letters, digits, ``_ . -`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def one_line(exc: BaseException | str) -> str:
    """An error (or any text) on one line: the form every message applier prints takes."""
    return " ".join(str(exc).split())


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
