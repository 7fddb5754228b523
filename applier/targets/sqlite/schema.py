"""A SQLite target's tables made to fit the source (``applier check``, ``applier sync``): the declared types and
affinities of the mapped values, the CREATE statements of a published table, the check of an existing one, and the
creation of the missing ones in one transaction.

Invariant: nothing is created unless every existing table fits; a failed statement leaves nothing created.
"""

from __future__ import annotations

import sqlite3

from applier.migrate.schema import Prepared, SchemaError, SourceTable, plain_where_generated, unfilled_columns
from applier.targets.sqlite.naming import sqlite_target_table
from applier.targets.sqlite.values import sqlite_affinity, sqlite_declared
from applier.text import quote_ident


def sqlite_declared_types(table: SourceTable) -> list[str]:
    """The declared SQLite type of each column, from what the engine's converter makes of a value."""
    return sqlite_declared(table.relation())


# Affinities that store every value of a mapped kind unchanged.
_KEEPS = {"INTEGER": {"INTEGER", "NUMERIC", "BLOB"}, "REAL": {"REAL", "BLOB"}, "TEXT": {"TEXT", "BLOB"},
          "BLOB": {"INTEGER", "NUMERIC", "BLOB", "REAL", "TEXT"}}



def sqlite_create_statements(table: SourceTable, name: str) -> list[str]:
    """CREATE TABLE (and unique index) statements for a SQLite target."""
    qt = quote_ident(name)
    parts = []
    for c, decl in zip(table.columns, sqlite_declared_types(table), strict=True):
        parts.append(f"{quote_ident(c.name)} {decl}" + (" NOT NULL" if c.not_null else ""))
    if table.primary_key and all(k in {c.name for c in table.columns} for k in table.primary_key):
        parts.append("PRIMARY KEY (" + ", ".join(quote_ident(k) for k in table.primary_key) + ")")
    stmts = [f"CREATE TABLE {qt} (" + ", ".join(parts) + ")"]
    if table.identity_index and table.identity_index[1] != table.primary_key:
        cols = table.identity_index[1]
        if all(k in {c.name for c in table.columns} for k in cols):
            stmts.append(f"CREATE UNIQUE INDEX {quote_ident(name + '_replica_identity')} ON {qt} ("
                         + ", ".join(map(quote_ident, cols)) + ")")
    return stmts


def check_sqlite_table(conn: sqlite3.Connection, table: SourceTable, name: str) -> list[str] | None:
    """Problems of an existing SQLite target table, or None if it does not exist."""
    rows = conn.execute(f"PRAGMA table_info({quote_ident(name)})").fetchall()
    if not rows:
        return None
    have = {r[1]: (r[2], bool(r[3]), r[4] is not None, r[5] > 0) for r in rows}
    problems = []
    for c, decl in zip(table.columns, sqlite_declared_types(table), strict=True):
        if c.name not in have:
            problems.append(f"column {c.name}: missing on the target (mapped type {decl})")
            continue
        aff = sqlite_affinity(have[c.name][0])
        if aff not in _KEEPS[decl]:
            problems.append(f"column {c.name}: declared {have[c.name][0] or '(none)'} ({aff} affinity) would change "
                            f"the mapped {decl} values of source type {c.type_sql}")
    problems += [plain_where_generated(c) for c in table.generated if c.name in have]  # table_info: plain ones only
    return problems + unfilled_columns(table, have)


def prepare_sqlite_tables(conn: sqlite3.Connection, tables: list[SourceTable], table_map: dict[str, str]) -> Prepared:
    """As ``prepare_pg_tables``, for a SQLite target."""
    problems: list[str] = []
    missing: list[tuple[SourceTable, str]] = []
    out = Prepared()
    for t in tables:
        name = sqlite_target_table(t.relation(), table_map)[1]
        if not t.columns:
            problems.append(f"source table {t.qualified} publishes no columns (all dropped or generated): a SQLite "
                            f"table needs one; leave it out of the publication or add a column to it")
            continue
        found = check_sqlite_table(conn, t, name)
        if found is None:
            missing.append((t, name))
        else:
            out.existing.append(name)
            problems += [f"target table {name} (source {t.qualified}), {p}" for p in found]
    if problems:
        raise SchemaError("the target does not fit the source:\n  " + "\n  ".join(problems))
    conn.execute("BEGIN IMMEDIATE")
    try:
        for t, name in missing:
            for stmt in sqlite_create_statements(t, name):
                conn.execute(stmt)
            out.created.append(name)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return out

