"""Published tables' contents on the source and on a target, compared directly, not with ``verify``.

Why: ``applier verify`` is applier's own code (Spark jobs, key ranges, its canonical form of values) and is itself
under test; a test that trusts it cannot see what it misses (a generated column it skips, a row it hashes the same
on both sides). This reads both databases directly. For each published table, on each side, one query gives its
row count, an md5 over the text of every row (every column, generated ones included) in the order of that text,
and for every column an md5 over its values' text in order: equal contents give equal digests, and the column
digests name the columns that differ. For a table that differs, both sides' rows are read to show a few rows
found on one side only.

On a SQLite target the values are compared as the README's mapping promises them
(``applier.targets.sqlite.values``, the documented mapping, applied to each source value as PostgreSQL prints it):
every row of the source, mapped, must be a row of the target table, and no other; a generated column the
publication does not send is left out there by design, so it is not compared.

Invariants: rows are read ``FROM ONLY`` the table (its own rows, as a publication publishes an inheritance parent;
a child is a table of its own), except a partitioned table published via its root, read with its partitions; the
source's row filter applies on the source side only. Both sessions print values the same way (``SESSION``), and
text is ordered by bytes (``COLLATE "C"``), so the digests do not depend on a database's settings. The columns are
the source table's, looked up by name on the target (a column the target lacks is named as missing).
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from applier.decoder.messages import Column, Relation
from applier.targets.sqlite.values import sqlite_text_converters
from applier.text import quote_ident

# settings that decide how values print as text: the same on both sides
SESSION = ("SET DateStyle = 'ISO, YMD'", "SET IntervalStyle = 'postgres'", "SET TimeZone = 'UTC'",
           "SET extra_float_digits = 1", "SET bytea_output = 'hex'", "SET lc_monetary = 'C'")
SAMPLES = 3  # rows shown per side for a table that differs
SHOWN = 160  # characters of a row's text shown


@dataclass(frozen=True)
class Published:
    """A published table: what its contents are on the source."""

    schema: str
    name: str
    relkind: str
    rowfilter: str | None
    columns: tuple[str, ...]  # every column of the source table, generated ones included, by position
    settable: str | None  # its first column that is not generated (None: it has none)
    generated: tuple[str, ...] = ()  # its generated columns

    @property
    def qualified(self) -> str:
        """schema.table, for people."""
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True)
class Digest:
    """One side's contents of one table."""

    rows: int
    whole: str | None  # md5 over the rows' text in order (None: no rows)
    columns: dict[str, str | None]  # column -> md5 over its values' text in order
    missing: tuple[str, ...] = ()  # source columns the table lacks (target side)


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection printing values as ``SESSION`` says."""
    conn = psycopg.connect(dsn, autocommit=True)
    for stmt in SESSION:
        conn.execute(stmt)
    return conn


def published_tables(conn: psycopg.Connection[Any], publication: str) -> list[Published]:
    """The tables ``publication`` publishes, with every column of each (generated ones included)."""
    rows = conn.execute(
        "SELECT p.schemaname::text, p.tablename::text, c.relkind::text, p.rowfilter, "
        "       coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a "
        "                 WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'), "
        "       (SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 "
        "        AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY a.attnum LIMIT 1), "
        "       coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a "
        "                 WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
        "                   AND a.attgenerated <> ''), '{}') "
        "FROM pg_publication_tables p JOIN pg_namespace n ON n.nspname = p.schemaname "
        "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename "
        "WHERE p.pubname = %s ORDER BY 1, 2", [publication]).fetchall()
    return [Published(s, t, k, f, tuple(cols), first, tuple(gen)) for s, t, k, f, cols, first, gen in rows]


def _from(table: Published, rowfilter: str | None) -> sql.Composable:
    only = sql.SQL("" if table.relkind == "p" else "ONLY ")
    where = sql.SQL(f" WHERE ({rowfilter})" if rowfilter else "")
    return sql.SQL("FROM {}{}{}").format(only, sql.Identifier(table.schema, table.name), where)


def _row_text(columns: tuple[str, ...]) -> sql.Composable:
    return sql.SQL("ROW({})::text").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns))


def digest(conn: psycopg.Connection[Any], table: Published, source: bool) -> Digest:
    """The table's contents on this side (``source``: apply the row filter; else look columns up by name)."""
    columns = table.columns
    missing: tuple[str, ...] = ()
    if not source:
        present = {r[0] for r in conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 "
            "AND NOT attisdropped", [sql.Identifier(table.schema, table.name).as_string(conn)])}
        missing = tuple(c for c in columns if c not in present)
        columns = tuple(c for c in columns if c in present)
    row = _row_text(columns)
    parts = [sql.SQL("count(*)"),
             sql.SQL("md5(string_agg({r}, E'\\n' ORDER BY {r} COLLATE \"C\"))").format(r=row)]
    for col in columns:
        value = sql.SQL("quote_nullable({}::text)").format(sql.Identifier(col))
        parts.append(sql.SQL("md5(string_agg({v}, ',' ORDER BY {v} COLLATE \"C\"))").format(v=value))
    query = sql.SQL("SELECT {} {}").format(sql.SQL(", ").join(parts), _from(table, table.rowfilter if source else None))
    got = conn.execute(query).fetchone()
    assert got is not None
    return Digest(int(got[0]), got[1], dict(zip(columns, got[2:], strict=True)), missing)


def rows(conn: psycopg.Connection[Any], table: Published, columns: tuple[str, ...], source: bool) -> Counter[str]:
    """Every row's text (the multiset)."""
    query = sql.SQL("SELECT {} {}").format(_row_text(columns), _from(table, table.rowfilter if source else None))
    return Counter(r[0] for r in conn.execute(query))


def _shown(texts: Counter[str]) -> str:
    out = [t if len(t) <= SHOWN else t[:SHOWN] + "…" for t in list(texts.elements())[:SAMPLES]]
    more = texts.total() - len(out)
    return "; ".join(out) + (f" (and {more} more)" if more > 0 else "")


def differences(source_dsn: str, target_dsn: str, tables: list[Published]) -> list[str]:
    """One line per table whose contents differ: counts, the columns that differ, rows found on one side only."""
    out = []
    with connect(source_dsn) as src, connect(target_dsn) as dst:
        for table in tables:
            exists = dst.execute("SELECT to_regclass(%s)",
                                 [sql.Identifier(table.schema, table.name).as_string(dst)]).fetchone()
            if exists is None or exists[0] is None:
                out.append(f"{table.qualified}: missing on the target")
                continue
            mine, theirs = digest(src, table, source=True), digest(dst, table, source=False)
            if mine == Digest(theirs.rows, theirs.whole, theirs.columns) and not theirs.missing:
                continue
            what = [f"{mine.rows} rows on the source, {theirs.rows} on the target"]
            if theirs.missing:
                what.append("columns missing on the target: " + ", ".join(theirs.missing))
            cols = [c for c in theirs.columns if theirs.columns[c] != mine.columns[c]]
            if cols:
                what.append("columns that differ: " + ", ".join(cols))
            shared = tuple(theirs.columns)
            a, b = rows(src, table, shared, source=True), rows(dst, table, shared, source=False)
            if a - b:
                what.append("only on the source: " + _shown(a - b))
            if b - a:
                what.append("only on the target: " + _shown(b - a))
            out.append(f"{table.qualified}: " + "; ".join(what))
    return out


def _sqlite_rows(src: psycopg.Connection[Any], table: Published) -> tuple[tuple[str, ...], Counter[tuple[Any, ...]]]:
    """The columns a SQLite target holds (all but the generated ones) and the source's rows mapped as the README
    says: each value as PostgreSQL prints it (its type's output function), through the documented mapping."""
    columns = tuple(c for c in table.columns if c not in table.generated)
    types = dict(src.execute("SELECT attname::text, atttypid::int FROM pg_attribute WHERE attrelid = %s::regclass "
                             "AND attnum > 0 AND NOT attisdropped",
                             [sql.Identifier(table.schema, table.name).as_string(src)]).fetchall())
    rel = Relation(None, 0, table.schema, table.name, "d", tuple(Column(0, c, types[c], -1) for c in columns))
    convert = sqlite_text_converters(rel)
    printed = sql.SQL(", ").join(sql.SQL("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END").format(
        c=sql.Identifier(c)) for c in columns)
    out: Counter[tuple[Any, ...]] = Counter()
    for row in src.execute(sql.SQL("SELECT {} {}").format(printed, _from(table, table.rowfilter))):
        out[tuple(None if v is None else f(v.encode()) for f, v in zip(convert, row, strict=True))] += 1
    return columns, out


def sqlite_differences(source_dsn: str, path: str, tables: list[Published]) -> list[str]:
    """One line per table whose rows on the SQLite file at ``path`` are not the source's, mapped: counts, the
    columns that differ (compared value by value in rows sorted the same way), rows found on one side only."""
    out = []
    dst = sqlite3.connect(path)
    try:
        with connect(source_dsn) as src:
            for table in tables:
                name = table.name if table.schema == "public" else table.qualified
                present = {r[1] for r in dst.execute(f"PRAGMA table_info({quote_ident(name)})")}
                if not present:
                    out.append(f"{table.qualified}: missing on the target")
                    continue
                columns, mine = _sqlite_rows(src, table)
                missing = [c for c in columns if c not in present]
                if missing:
                    out.append(f"{table.qualified}: columns missing on the target: " + ", ".join(missing))
                    continue
                theirs = Counter(dst.execute("SELECT {} FROM {}".format(", ".join(quote_ident(c) for c in columns),
                                                                         quote_ident(name))).fetchall())
                if mine == theirs:
                    continue
                what = [f"{mine.total()} rows on the source, {theirs.total()} on the target"]
                cols = [c for i, c in enumerate(columns)
                        if Counter(r[i] for r in mine.elements()) != Counter(r[i] for r in theirs.elements())]
                if cols:
                    what.append("columns that differ: " + ", ".join(cols))
                for side, rows_ in (("source", mine - theirs), ("target", theirs - mine)):
                    if rows_:
                        what.append(f"only on the {side}: " + _shown(Counter({repr(r): n for r, n in rows_.items()})))
                out.append(f"{table.qualified}: " + "; ".join(what))
    finally:
        dst.close()
    return out
