"""Published tables: read from the source's catalog, created or checked on the target.

Library code behind ``applier sync`` (and the table list of ``applier verify``).

What is published: ``pg_publication_tables`` of the configured publications,
with their column lists (``attnames``) and row filters (``rowfilter``) on
PostgreSQL 15+. A table in several publications gets the union of the column
lists and the OR of the row filters (no filter if any publication has none),
as the walsender does.

Target tables are named as the apply engine names them (one function,
``applier.targets.naming.target_table``), so the copy and the stream write to
the same table.

Created on PostgreSQL: the published columns with the source's types
(``format_type``), collations other than the type's default, NOT NULL,
defaults that are constants (no function call, operator, variable or
sub-query; ``nextval`` and ``now()`` are left out), the primary key, the
unique index used as replica identity (and the replica identity setting).
The user-defined types, functions and collations they need are created first
(``applier.migrate.usertypes``), or named, all in one refusal, when they cannot be.

Created on SQLite: every published column with the declared type of the apply
engine's documented mapping (``applier.targets.sqlite.values``: INTEGER, REAL, TEXT,
BLOB, derived from ``sqlite_text_converters`` itself, so there is one mapping),
NOT NULL, the primary key and the replica identity index as a unique index.
A generated column the publication sends (PostgreSQL 18+: ``publish_generated_columns =
stored`` or a column list naming it; ``attnames`` lists it) is created as a plain column of its
type and copied like any other, as the stream writes its values; one it does not send is created
GENERATED on PostgreSQL (computed by the target) and left out on SQLite.
A table that publishes no columns (all dropped or generated: PostgreSQL allows
it, pgoutput publishes its rows) is created on PostgreSQL and refused on SQLite,
which cannot hold it, in the list of problems.

Rows: a published table's own rows (``SourceTable.only``), as PostgreSQL's
table sync copies them; ``pg_publication_tables`` already lists inheritance
children and partitions as the publication's ``publish_via_partition_root``
wants them (the leaves, or the root with its partitions' rows).

An existing target table is checked instead: every published column must exist
with the same type (PostgreSQL: same type name, modifiers may differ; SQLite: a
declared type whose affinity keeps the mapped values as they are), and a target
column the source does not publish must be nullable or have a default, and one the
source generates without sending it must not be a plain column (it would stay NULL).
Every mismatch is reported, by table and column, before anything is written.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from applier.config import ConfigError
from applier.decoder.messages import Column, Relation
from applier.migrate.sequences import (
    SourceSequence,
    create_statements,
    identity_sql,
    nextval_default,
    setval_statement,
    source_sequences,
    target_sequence_qname,
)
from applier.migrate.usertypes import plan_types, source_types
from applier.targets.backend import Backend
from applier.targets.naming import quoted_name, shown_name
from applier.targets.postgres.naming import pg_target_table
from applier.targets.sqlite.naming import sqlite_target_table
from applier.targets.sqlite.values import sqlite_affinity, sqlite_declared
from applier.text import one_line, quote_ident
from applier.url import Kind


class SchemaError(ConfigError):
    """Target tables that do not fit the source; the message names every table and column."""


@dataclass
class SourceColumn:
    """One published column of a source table."""

    name: str
    type_oid: int
    type_mod: int
    type_sql: str  # format_type(atttypid, atttypmod), e.g. "numeric(12,3)"
    type_name: str  # format_type(atttypid, NULL), e.g. "numeric"
    type_schema: str
    not_null: bool
    default: str | None  # the default when it is a constant, else None
    collation: str | None  # a collation other than the type's default, quoted and schema-qualified
    attnum: int = 0  # its position in the source table
    identity: str = ""  # 'a': GENERATED ALWAYS AS IDENTITY, 'd': BY DEFAULT, '': not an identity column
    generated: str = ""  # 's': GENERATED ALWAYS AS (expression) STORED, 'v': VIRTUAL (18+), '': not generated
    expression: str | None = None  # the generation expression, or a default that is not a constant (pg_get_expr)


@dataclass
class SourceTable:
    """A published source table: what to copy and how to create it."""

    schema: str
    name: str
    oid: int
    relkind: str  # 'r' table, 'p' partitioned table
    replica_identity: str  # 'd', 'n', 'f', 'i'
    columns: list[SourceColumn]
    primary_key: list[str] = field(default_factory=list)
    identity_index: tuple[str, list[str]] | None = None  # (index name, columns) for REPLICA IDENTITY USING INDEX
    rowfilter: str | None = None
    pages: int = 0  # heap pages (the largest leaf's for a partitioned table)
    estimated_rows: int | None = None
    unpublished: list[str] = field(default_factory=list)  # columns the column lists leave out
    generated: list[SourceColumn] = field(default_factory=list)  # generated columns not published: created, not copied
    # the whole table's size in pages: every leaf of a partitioned table, TOAST included (what a copy of all its
    # ctid ranges reads: ``applier.migrate.spark.copy.task_groups`` bounds a group's work by it)
    size_pages: int = 0

    @property
    def only(self) -> bool:
        """Whether its rows are read ``FROM ONLY`` it, as PostgreSQL's table sync reads them: a publication
        publishes an inheritance parent's own rows (its children are tables of their own); only a partitioned
        table (published via its root) is read with its partitions' rows."""
        return self.relkind != "p"

    @property
    def qualified(self) -> str:
        """schema.table as text (for people and as the key of ``target.tables``)."""
        return f"{self.schema}.{self.name}"

    @property
    def qname(self) -> str:
        """Quoted "schema"."table" for SQL."""
        return f"{quote_ident(self.schema)}.{quote_ident(self.name)}"

    @property
    def key_columns(self) -> list[str]:
        """Columns that identify a row: the primary key, else the replica identity index; [] if neither."""
        names = {c.name for c in self.columns}
        for cand in (self.primary_key, self.identity_index[1] if self.identity_index else []):
            if cand and all(k in names for k in cand):
                return list(cand)
        return []

    def relation(self) -> Relation:
        """The table as a Relation message would describe it (key flags as for the replica identity)."""
        keys = set(self.columns_sent_as_key())
        cols = tuple(Column(1 if c.name in keys else 0, c.name, c.type_oid, c.type_mod) for c in self.columns)
        return Relation(None, self.oid, self.schema, self.name, self.replica_identity, cols)

    def columns_sent_as_key(self) -> list[str]:
        """Columns pgoutput flags as the replica identity."""
        if self.replica_identity == "f":
            return [c.name for c in self.columns]
        if self.replica_identity == "i" and self.identity_index:
            return self.identity_index[1]
        if self.replica_identity == "d":
            return self.primary_key
        return []


# -- reading the source ------------------------------------------------------

_NOT_CONSTANT = re.compile(r"\{(VAR|SUBLINK|OPEXPR|NEXTVALUEEXPR|SQLVALUEFUNCTION|PARAM|CASE|"
                           r"DISTINCTEXPR|SCALARARRAYOPEXPR|BOOLEXPR|MINMAXEXPR|XMLEXPR|WINDOWFUNC|AGGREF)\b")
_CALL = re.compile(r"\{FUNCEXPR [^{}]*?:funcformat (\d)")


def default_is_constant(node_tree: str) -> bool:
    """True when a default's node tree (``pg_attrdef.adbin``) is a constant, perhaps cast.

    Function calls written as calls (funcformat 0, ``now()``, ``nextval(…)``) or
    in SQL syntax (3, ``CURRENT_TIMESTAMP`` on 16+), operators, variables and
    sub-queries make it not a constant; casts (funcformat 1 and 2) do not.
    """
    if _NOT_CONSTANT.search(node_tree):
        return False
    return all(fmt in ("1", "2") for fmt in _CALL.findall(node_tree))


def read_source_tables(conn: psycopg.Connection[Any], publications: list[str]) -> list[SourceTable]:
    """The published tables with their published columns, keys, row filters and sizes, by name."""
    v15 = conn.info.server_version >= 150000
    extra = ", attnames, rowfilter" if v15 else ", NULL::name[], NULL::text"
    pubs: dict[tuple[str, str], list[tuple[list[str] | None, str | None]]] = {}
    for schema, name, attnames, rowfilter in conn.execute(
            f"SELECT schemaname, tablename{extra} FROM pg_publication_tables WHERE pubname = ANY(%s)",
            [publications]):
        pubs.setdefault((schema, name), []).append((attnames, rowfilter))
    tables = []
    for (schema, name), entries in sorted(pubs.items()):
        tables.append(_read_table(conn, schema, name, entries, conn.info.server_version >= 180000))
    return tables


def _one(conn: psycopg.Connection[Any], sql: str, params: list[Any]) -> tuple[Any, ...]:
    """The one row a catalog query returns."""
    row = conn.execute(sql, params).fetchone()
    if row is None:
        raise SchemaError(f"the catalog query returned no row: {sql[:80]}")
    return tuple(row)


def _read_table(conn: psycopg.Connection[Any], schema: str, name: str,
                entries: list[tuple[list[str] | None, str | None]], sends_generated: bool) -> SourceTable:
    """``sends_generated``: an 18+ source, whose pgoutput sends the generated columns ``attnames`` lists (before
    18, ``attnames`` lists them too when there is no column list, but they are never sent)."""
    oid, relkind, replident, reltuples = _one(
        conn, "SELECT c.oid, c.relkind, c.relreplident, c.reltuples::bigint FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s", [schema, name])
    listed: set[str] = set()
    published: set[str] | None = listed
    for attnames, _ in entries:
        if attnames is None:
            published = None
            break
        listed |= set(attnames)
    filters = [f for _, f in entries]
    distinct = list(dict.fromkeys(filters))
    if any(f is None for f in distinct):
        rowfilter = None
    else:
        rowfilter = distinct[0] if len(distinct) == 1 else " OR ".join(f"({f})" for f in distinct)
    cols: list[SourceColumn] = []
    unpublished: list[str] = []
    gen_cols: list[SourceColumn] = []
    for (attname, typid, typmod, type_sql, type_name, type_schema, notnull, adbin, adsrc, collname,
         default_coll, attnum, identity, generated, reads) in conn.execute(
            "SELECT a.attname, a.atttypid::int, a.atttypmod, format_type(a.atttypid, a.atttypmod), "
            "format_type(a.atttypid, NULL), tn.nspname, a.attnotnull, d.adbin::text, "
            "pg_get_expr(d.adbin, d.adrelid), CASE WHEN co.oid IS NOT NULL THEN format('%%I.%%I', cn.nspname, co.collname) END, "
            "a.attcollation = t.typcollation, a.attnum, "
            "a.attidentity::text, a.attgenerated::text, "
            "array(SELECT r.attname FROM pg_depend x JOIN pg_attribute r ON r.attrelid = x.refobjid "
            "      AND r.attnum = x.refobjsubid WHERE x.classid = 'pg_attrdef'::regclass AND x.objid = d.oid "
            "      AND x.refobjsubid > 0 AND x.deptype = 'n') "  # the columns a generation expression reads
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "JOIN pg_namespace tn ON tn.oid = t.typnamespace "
            "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
            "LEFT JOIN pg_collation co ON co.oid = a.attcollation "
            "LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace "
            "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum", [oid]):
        if generated and sends_generated and published is not None and attname in published:
            # sent by pgoutput (18+: publish_generated_columns = stored, or named in a column list): a plain
            # column of its type on the target, copied like any other, so that the stream can write it
            cols.append(SourceColumn(attname, typid, typmod, type_sql, type_name, type_schema, notnull, None,
                                     collname if collname and not default_coll else None, attnum))
            continue
        if generated:  # not sent: created when what it reads is published, computed by the target
            if published is None or set(reads) <= published:
                gen_cols.append(SourceColumn(attname, typid, typmod, type_sql, type_name, type_schema, notnull, None,
                                             collname if collname and not default_coll else None, attnum, "",
                                             generated, adsrc))
            continue
        if published is not None and attname not in published:
            unpublished.append(attname)
            continue
        default = adsrc if adbin is not None and default_is_constant(adbin) else None
        collation = collname if collname and not default_coll else None
        cols.append(SourceColumn(attname, typid, typmod, type_sql, type_name, type_schema, notnull, default, collation,
                                 attnum, identity, "", adsrc if default is None else None))
    pk: list[str] = []
    ident: tuple[str, list[str]] | None = None
    for idxname, primary, replident_idx, colnames in conn.execute(
            "SELECT ic.relname, i.indisprimary, i.indisreplident, "
            "array(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY k(n, o) "
            "      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n WHERE k.o <= i.indnkeyatts "
            "      ORDER BY k.o) "  # key columns only: not those of INCLUDE (…)
            "FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
            "WHERE i.indrelid = %s AND (i.indisprimary OR i.indisreplident)", [oid]):
        if primary:
            pk = list(colnames)
        if replident_idx:
            ident = (idxname, list(colnames))
    if relkind == "p":
        pages_sql = ("SELECT coalesce(max(pg_relation_size(relid)), 0) / current_setting('block_size')::int, "
                     "sum(greatest(c.reltuples, 0))::bigint, bool_or(c.reltuples < 0), "
                     "coalesce(sum(pg_table_size(relid)), 0) / current_setting('block_size')::int "
                     "FROM pg_partition_tree(%s) t JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf")
        pages, leaf_rows, unknown, size = _one(conn, pages_sql, [oid])
        estimated = None if unknown else leaf_rows
    else:
        pages, size = _one(conn, "SELECT pg_relation_size(%s) / current_setting('block_size')::int, "
                                 "pg_table_size(%s) / current_setting('block_size')::int", [oid, oid])
        estimated = reltuples if reltuples is not None and reltuples >= 0 else None
    return SourceTable(schema, name, oid, relkind, replident, cols, pk, ident, rowfilter, int(pages or 0),
                       None if estimated is None else int(estimated), unpublished, gen_cols,
                       int(size or 0))


# -- target names ------------------------------------------------------------------

def target_table_name(table: SourceTable, backend: Backend, table_map: dict[str, str]) -> tuple[str, str]:
    """(name for people, quoted name for SQL) of the target table, as the apply engine names it
    (``Backend.target_table``)."""
    schema, name = backend.target_table(table.relation(), table_map)
    return shown_name(schema, name), quoted_name(schema, name)


# -- SQLite mapping ------------------------------------------------------------------

def sqlite_declared_types(table: SourceTable) -> list[str]:
    """The declared SQLite type of each column, from what the engine's converter makes of a value."""
    return sqlite_declared(table.relation())


# Affinities that store every value of a mapped kind unchanged.
_KEEPS = {"INTEGER": {"INTEGER", "NUMERIC", "BLOB"}, "REAL": {"REAL", "BLOB"}, "TEXT": {"TEXT", "BLOB"},
          "BLOB": {"INTEGER", "NUMERIC", "BLOB", "REAL", "TEXT"}}


# -- create or check --------------------------------------------------------------------

@dataclass
class Prepared:
    """What ``prepare_target_tables`` did: tables created and tables found."""

    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)


def pg_create_statements(table: SourceTable, schema: str | None, name: str, sequences: list[SourceSequence],
                         table_map: dict[str, str], version: int) -> list[str]:
    """CREATE TABLE (and index / replica identity) statements for a PostgreSQL target of server ``version``.

    Columns in the source's order, the generated ones too; identity columns with their sequence (name and options
    from ``sequences``); a default ``nextval('…')`` of a sequence in ``sequences`` calls the target's sequence
    (``applier.migrate.sequences``). A VIRTUAL generated column is STORED on a target before 18.
    """
    qt = quoted_name(schema, name)
    parts = []
    uses = {u: q for q in sequences for u in q.used_by}
    for c in sorted(table.columns + table.generated, key=lambda c: c.attnum):
        s = f"{quote_ident(c.name)} {c.type_sql}"
        if c.collation:
            s += f" COLLATE {c.collation}"
        seq = uses.get((table.schema, table.name, c.name))
        if c.generated:
            virtual = c.generated == "v" and version >= 180000
            s += f" GENERATED ALWAYS AS ({c.expression}) {'VIRTUAL' if virtual else 'STORED'}"
        elif c.identity and seq is not None:
            s += " " + identity_sql(seq, table_map)
        if c.not_null:
            s += " NOT NULL"
        if c.default is not None:
            s += f" DEFAULT {c.default}"
        elif c.expression is not None and not c.generated and seq is not None:
            default = nextval_default(c.expression, seq, table_map)
            if default:
                s += f" DEFAULT {default}"
        parts.append(s)
    if table.primary_key and all(k in {c.name for c in table.columns} for k in table.primary_key):
        parts.append("PRIMARY KEY (" + ", ".join(quote_ident(k) for k in table.primary_key) + ")")
    stmts = []
    if schema:
        stmts.append(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
    stmts.append(f"CREATE TABLE {qt} (" + ", ".join(parts) + ")")
    if table.replica_identity == "i" and table.identity_index and table.identity_index[1] != table.primary_key:
        idx, cols = table.identity_index
        stmts.append(f"CREATE UNIQUE INDEX {quote_ident(idx)} ON {qt} (" + ", ".join(map(quote_ident, cols)) + ")")
        stmts.append(f"ALTER TABLE {qt} REPLICA IDENTITY USING INDEX {quote_ident(idx)}")
    elif table.replica_identity == "f":
        stmts.append(f"ALTER TABLE {qt} REPLICA IDENTITY FULL")
    elif table.replica_identity == "n":
        stmts.append(f"ALTER TABLE {qt} REPLICA IDENTITY NOTHING")
    return stmts


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


def plain_where_generated(column: SourceColumn) -> str:
    """The problem of a target column that is plain where the source's is generated (and not sent)."""
    return (f"column {column.name}: generated on the source as {column.expression}, a plain column on the target: the "
            f"source does not send its values, so it would stay NULL; make it a generated column on the target or "
            f"drop it")


def check_pg_table(conn: psycopg.Connection[Any], table: SourceTable, schema: str | None, name: str) -> list[str] | None:
    """Problems of an existing PostgreSQL target table (one line each), or None if it does not exist."""
    reg = _one(conn, "SELECT to_regclass(%s)::oid", [quoted_name(schema, name)])[0]
    if reg is None:
        return None
    have = {r[0]: r[1:] for r in conn.execute(
        "SELECT attname, format_type(atttypid, NULL), attnotnull, atthasdef OR attidentity <> '' OR attgenerated <> '', "
        "attgenerated <> '' FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped", [reg])}
    problems = []
    for c in table.columns:
        if c.name not in have:
            problems.append(f"column {c.name}: missing on the target (source type {c.type_sql})")
        elif have[c.name][0] != c.type_name:
            problems.append(f"column {c.name}: source type {c.type_sql}, target type {have[c.name][0]}")
    problems += [plain_where_generated(c) for c in table.generated if c.name in have and not have[c.name][3]]
    return problems + unfilled_columns(table, have)


def unfilled_columns(table: SourceTable, have: dict[str, tuple[Any, bool, bool, bool]]) -> list[str]:
    """The problems of target columns the source does not publish that are NOT NULL without a default (``have``:
    each target column's (type, NOT NULL, has a default, …))."""
    published = {c.name for c in table.columns}
    return [f"column {col}: NOT NULL on the target without a default, and the source does not publish it"
            for col, (_, notnull, hasdef, _) in have.items() if col not in published and notnull and not hasdef]


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


def prepare_pg_tables(conn: psycopg.Connection[Any], tables: list[SourceTable], table_map: dict[str, str],
                      source: psycopg.Connection[Any]) -> Prepared:
    """Check every existing target table, then create the missing ones with the user types and sequences they need
    (read from ``source``: ``applier.migrate.usertypes``, ``applier.migrate.sequences``), all in one target
    transaction; SchemaError naming every mismatch (table and column, or type) before anything is created, or the
    statement that failed (then nothing is created)."""
    problems: list[str] = []
    missing: list[SourceTable] = []
    out = Prepared()
    for t in tables:
        schema, name = pg_target_table(t.relation(), table_map)
        shown = shown_name(schema, name)
        found = check_pg_table(conn, t, schema, name)
        if found is None:
            missing.append(t)
        else:
            out.existing.append(shown)
            problems += [f"target table {shown} (source {t.qualified}), {p}" for p in found]
    shown_of = {t.qualified: shown_name(*pg_target_table(t.relation(), table_map)) for t in missing}
    types = source_types(source, [(shown_of[t.qualified], c.name, c.type_oid, (t.oid, c.attnum, bool(c.generated)))
                                  for t in missing for c in t.columns + t.generated])
    type_sql, type_problems = plan_types(conn, types)
    problems += type_problems
    if problems:
        raise SchemaError("the target does not fit the source:\n  " + "\n  ".join(problems))
    sequences = source_sequences(source, missing)
    new_seqs = [q for q in sequences if _one(conn, "SELECT to_regclass(%s)", [target_sequence_qname(q, table_map)])[0]
                is None]
    created = {(t.schema, t.name) for t in missing}
    statements = list(type_sql)
    statements += [s for q in new_seqs if not q.identity for s in create_statements(q, table_map)]
    for t in missing:
        schema, name = pg_target_table(t.relation(), table_map)
        statements += pg_create_statements(t, schema, name, sequences, table_map, conn.info.server_version)
        out.created.append(shown_name(schema, name))
    for q in new_seqs:
        if q.owner is not None and not q.identity and q.owner[:2] in created:
            schema, name = pg_target_table(next(t for t in missing if (t.schema, t.name) == q.owner[:2]).relation(),
                                           table_map)
            statements.append(f"ALTER SEQUENCE {target_sequence_qname(q, table_map)} OWNED BY "
                              f"{quoted_name(schema, name)}.{quote_ident(q.owner[2])}")
        statements.append(setval_statement(q, table_map))
    stmt = "BEGIN"
    try:
        with conn.transaction():
            for stmt in statements:
                conn.execute(stmt)
    except psycopg.Error as exc:
        raise SchemaError(f"creating the target's tables failed, nothing was created: {one_line(exc)} "
                          f"(in: {one_line(stmt)[:300]})") from None
    return out


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


# The table checks and creation of each kind of target (``applier check``, ``applier sync``).
def _check_pg(conn: Any, table: SourceTable, schema: str | None, name: str) -> list[str] | None:
    return check_pg_table(conn, table, schema, name)


def _check_sqlite(conn: Any, table: SourceTable, schema: str | None, name: str) -> list[str] | None:
    return check_sqlite_table(conn, table, name)


_CHECKS: dict[Kind, Callable[[Any, SourceTable, str | None, str], list[str] | None]] = {
    Kind.POSTGRESQL: _check_pg, Kind.SQLITE: _check_sqlite,
}


def check_table(backend: Backend, conn: Any, table: SourceTable, schema: str | None, name: str) -> list[str] | None:
    """What does not fit the source in target table ``name`` (``schema``) of a kind of target (None: it does not
    exist): ``check_pg_table``, ``check_sqlite_table``."""
    return _CHECKS[backend.kind](conn, table, schema, name)


def prepare_tables(backend: Backend, conn: Any, tables: list[SourceTable], table_map: dict[str, str],
                   source: Callable[[], AbstractContextManager[psycopg.Connection[Any]]]) -> Prepared:
    """``prepare_pg_tables`` (with a connection to the source, from ``source``), ``prepare_sqlite_tables``."""
    if backend.kind is Kind.SQLITE:
        return prepare_sqlite_tables(conn, tables, table_map)
    if backend.kind is Kind.POSTGRESQL:
        with source() as src:
            return prepare_pg_tables(conn, tables, table_map, src)
    raise SchemaError(f"applier cannot create tables on a target of kind {backend.kind}")
