"""Which row path runs: the compiled one or the pure-Python twins.

``applier._rowpath`` (Cython, ``applier/_rowpath.pyx``) is built by ``pip install``
where a C compiler exists. It is used when it imports and ``APPLIER_PURE_PYTHON``
is unset (or ``0``); otherwise every caller runs the pure-Python twin of each of
its functions, with the same results and the same errors. Decided once, at
import: the row path never changes within a process.

Every module picks its twin in one way, at import, beside the pure function:
``name = twin("compiled_name", name_pure)``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TypeVar, cast

F = TypeVar("F")


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("APPLIER_PURE_PYTHON", "") not in ("", "0"):
        return None, "APPLIER_PURE_PYTHON is set"
    try:
        from applier import _rowpath
    except ImportError as exc:  # not built here (no C compiler at install time): the pure path
        return None, f"the compiled module is not available: {exc}"
    return _rowpath, "built at install"


rowpath, _why = _load()
IMPLEMENTATION = "compiled" if rowpath is not None else "pure"


def twin(name: str, pure: F) -> F:
    """``applier._rowpath``'s function ``name`` when the compiled row path runs, else ``pure`` (its twin)."""
    return cast(F, getattr(rowpath, name)) if rowpath is not None else pure


def describe() -> str:
    """Which row path runs and why, for ``applier --version``."""
    return f"{IMPLEMENTATION} row path ({_why})"
