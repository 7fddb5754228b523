"""A partition of a PostgreSQL table read in the exported snapshot: its connection and its query.

What every reader of a ctid-range partition shares (the copy's tasks, ``applier.migrate.spark.pgcopy``; the data
source ``applier_pg`` of ``applier.migrate.spark.source``; verify's hashes on the servers,
``applier.migrate.spark.rangehash``; ``applier repair``): a connection with the walsender's output settings pinned
(``pinned_dsn``), inside a read-only repeatable-read transaction that sees the plan's snapshot (``pg_in_snapshot``),
and the SELECT of one page range (``range_query``). The plan is ``applier.migrate.spark.plans.pg_plan``'s, parsed.

Imports neither pyspark nor pyarrow: a Spark task that only moves COPY data loads psycopg and this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql as psql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from applier.source.session import session_dsn


def pinned_dsn(dsn: str, application_name: str | None = None) -> str:
    """``dsn`` with the output settings of the decoding session (``session_dsn``: UTF-8, ISO dates, UTC) plus hex
    bytea."""
    base = session_dsn(dsn)
    opts = conninfo_to_dict(base).get("options") or ""
    extra: dict[str, Any] = {"options": f"{opts} -c bytea_output=hex".strip()}
    if application_name:
        extra["application_name"] = application_name
    return make_conninfo(base, **extra)


def range_query(plan: dict[str, Any], lo: int | None, hi: int | None) -> str:
    """The SELECT of one partition."""
    conds = []
    if lo is not None:
        conds.append(f"ctid >= '({int(lo)},0)'::tid")
    if hi is not None:
        conds.append(f"ctid < '({int(hi)},0)'::tid")
    if plan.get("where"):
        conds.append(f"({plan['where']})")
    q = f"SELECT {', '.join(plan['columns'])} FROM {'ONLY ' if plan.get('only', True) else ''}{plan['table']}"
    return q + (" WHERE " + " AND ".join(conds) if conds else "")


def pg_connect(plan: dict[str, Any], index: int) -> psycopg.Connection[Any]:
    """An autocommit connection for partition ``index`` of a ``pg_plan`` (pinned settings, ``<app> p<index>``)."""
    return psycopg.connect(pinned_dsn(plan["dsn"], f"{plan['app']} p{index}"), autocommit=True)


@contextlib.contextmanager
def snapshot_transaction(conn: psycopg.Connection[Any], plan: dict[str, Any]) -> Iterator[psycopg.Connection[Any]]:
    """A read-only repeatable-read transaction on autocommit ``conn`` that sees the plan's snapshot (if it has one);
    committed on success (an exported snapshot can be taken again by the next one, while its exporter lives)."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    if plan.get("snapshot"):
        conn.execute(psql.SQL("SET TRANSACTION SNAPSHOT {}").format(psql.Literal(plan["snapshot"])))
    yield conn
    conn.execute("COMMIT")


@contextlib.contextmanager
def pg_in_snapshot(plan: dict[str, Any], index: int) -> Iterator[psycopg.Connection[Any]]:
    """A connection for partition ``index`` of a ``pg_plan`` (``pg_connect``), inside a ``snapshot_transaction``;
    closed at the end."""
    conn = pg_connect(plan, index)
    try:
        with snapshot_transaction(conn, plan):
            yield conn
    finally:
        conn.close()
