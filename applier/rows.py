"""The one row of a query that always returns one (SHOW, SELECT of a function), typed for the checker."""

from __future__ import annotations

from typing import Any


def one_row(cursor: Any) -> tuple[Any, ...]:
    """``cursor.fetchone()`` of a query that returns exactly one row (psycopg or sqlite3 cursor)."""
    row = cursor.fetchone()
    if row is None:
        raise RuntimeError("a query that always returns a row returned none")
    return tuple(row)
