"""Published tables: read from the source's catalog, created or checked on the target.

Library code behind ``applier sync`` (and the table list of ``applier verify``). What differs by kind of target
(the CREATE statements, the checks, the creation) is each kind's, in ``applier/targets/<kind>/schema.py``, reached
through its ``Backend`` (``check_table``, ``prepare_tables``).

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
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from applier.config import ConfigError
from applier.decoder.messages import Column, Relation
from applier.targets.backend import Backend
from applier.targets.naming import quoted_name, shown_name
from applier.text import quote_ident


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


def catalog_row(conn: psycopg.Connection[Any], sql: str, params: list[Any]) -> tuple[Any, ...]:
    """The one row a catalog query returns."""
    row = conn.execute(sql, params).fetchone()
    if row is None:
        raise SchemaError(f"the catalog query returned no row: {sql[:80]}")
    return tuple(row)


def _read_table(conn: psycopg.Connection[Any], schema: str, name: str,
                entries: list[tuple[list[str] | None, str | None]], sends_generated: bool) -> SourceTable:
    """``sends_generated``: an 18+ source, whose pgoutput sends the generated columns ``attnames`` lists (before
    18, ``attnames`` lists them too when there is no column list, but they are never sent)."""
    oid, relkind, replident, reltuples = catalog_row(
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
        pages, leaf_rows, unknown, size = catalog_row(conn, pages_sql, [oid])
        estimated = None if unknown else leaf_rows
    else:
        pages, size = catalog_row(conn, "SELECT pg_relation_size(%s) / current_setting('block_size')::int, "
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


# -- create or check (each kind's ``Backend.check_table`` / ``prepare_tables``, in ``targets/<kind>/schema.py``) ----

@dataclass
class Prepared:
    """What ``prepare_target_tables`` did: tables created and tables found."""

    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)


def plain_where_generated(column: SourceColumn) -> str:
    """The problem of a target column that is plain where the source's is generated (and not sent)."""
    return (f"column {column.name}: generated on the source as {column.expression}, a plain column on the target: the "
            f"source does not send its values, so it would stay NULL; make it a generated column on the target or "
            f"drop it")


def unfilled_columns(table: SourceTable, have: dict[str, tuple[Any, bool, bool, bool]]) -> list[str]:
    """The problems of target columns the source does not publish that are NOT NULL without a default (``have``:
    each target column's (type, NOT NULL, has a default, …))."""
    published = {c.name for c in table.columns}
    return [f"column {col}: NOT NULL on the target without a default, and the source does not publish it"
            for col, (_, notnull, hasdef, _) in have.items() if col not in published and notnull and not hasdef]


def check_table(backend: Backend, conn: Any, table: SourceTable, schema: str | None, name: str) -> list[str] | None:
    """What does not fit the source in target table ``name`` (``schema``) of a kind of target (None: it does not
    exist): ``Backend.check_table``."""
    return backend.check_table(conn, table, schema, name)


def prepare_tables(backend: Backend, conn: Any, tables: list[SourceTable], table_map: dict[str, str],
                   source: Callable[[], AbstractContextManager[psycopg.Connection[Any]]]) -> Prepared:
    """Check the target's tables and create the missing ones: ``Backend.prepare_tables``."""
    done: Prepared = backend.prepare_tables(conn, tables, table_map, source)
    return done
