"""The ``plan`` option of the Spark data sources of ``applier.migrate.spark.source`` (``applier_pg``,
``applier_sqlite``), made on the driver: JSON of everything a partition's reader needs (it runs in another process).

Imports nothing of applier and nothing of Spark: each kind of target makes the plan of its own tables
(``Backend.read_plan``) without loading the data sources.
"""

from __future__ import annotations

import json

MIN_PAGES_PER_PARTITION = 16


def ctid_ranges(pages: int, partitions: int) -> list[tuple[int | None, int | None]]:
    """Page ranges covering a heap of ``pages`` pages; first and last open-ended."""
    n = max(1, min(partitions, pages // MIN_PAGES_PER_PARTITION if pages >= MIN_PAGES_PER_PARTITION else 1))
    bounds = [pages * i // n for i in range(n + 1)]
    return [(None if i == 0 else bounds[i], None if i == n - 1 else bounds[i + 1]) for i in range(n)]


def pg_plan(dsn: str, table: str, columns: list[str], *, pages: int, partitions: int, snapshot: str | None = None,
            where: str | None = None, app: str = "applier", canonical_types: list[int] | None = None,
            only: bool = True) -> str:
    """The ``plan`` option of ``applier_pg``: quoted table and column names (or SQL expressions), filter, ranges,
    snapshot, ``only`` (the table without its inheritance children)."""
    return json.dumps({
        "dsn": dsn, "table": table, "columns": columns, "where": where, "snapshot": snapshot, "app": app,
        "ranges": ctid_ranges(pages, partitions), "canonical": canonical_types, "only": only,
    })


def sqlite_plan(path: str, table: str, columns: list[str], ranges: list[tuple[int | None, int | None]]) -> str:
    """The ``plan`` option of ``applier_sqlite``."""
    return json.dumps({"path": path, "table": table, "columns": columns, "ranges": ranges})
