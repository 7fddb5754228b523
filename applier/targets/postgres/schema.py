"""A PostgreSQL target's tables made to fit the source (``applier check``, ``applier sync``): the CREATE statements
of a published table, the check of an existing one, and the creation of the missing ones with their user types and
sequences in one transaction.

Keys after the data (as pg_dump and pgcopydb build them): a table created here has no primary key nor replica
identity index yet, and has a row in the control table ``applier_keys_owed`` (its oid and name), written in the transaction
that creates it; the copy fills it, then ``build_pg_keys`` builds them and deletes the row in one transaction. So the
row says, across a killed sync and its rerun, that the table is applier's and owes its keys (a rerun empties and
copies it, then builds them); a table that was there before (a user's, ``pg_dump --schema-only``) never has one, and
keeps its indexes as they are. Nothing a user does to the table short of dropping it removes the row (a comment, the
mark before migration 0010, was lost to a ``COMMENT ON TABLE`` during the copy, and the keys never built); a row whose
table is gone is deleted when tables are next created.

Invariant: nothing is created unless every existing table fits; a failed statement leaves nothing created.
"""

from __future__ import annotations

from typing import Any

import psycopg

from applier.migrate.schema import (
    Prepared,
    SchemaError,
    SourceTable,
    catalog_row,
    plain_where_generated,
    unfilled_columns,
)
from applier.migrate.sequences import (
    SourceSequence,
    create_statements,
    identity_sql,
    nextval_default,
    setval_statement,
    source_sequences,
    target_sequence_name,
    target_sequence_qname,
)
from applier.migrate.usertypes import plan_types, source_types
from applier.targets.naming import quoted_name, shown_name
from applier.targets.postgres.naming import pg_shape_table, pg_target_table
from applier.targets.postgres.sequences import owned_sequence
from applier.text import one_line, quote_ident, quote_literal

# the control table of the target tables created without their keys yet (see the module header; migration 0010)
KEYS_OWED = "applier_keys_owed"
# a row's table_name: the table's schema and name as the catalog has them (pg_class c, pg_namespace n); a row is the
# table's only if both its oid and this name are (an oid alone may be another table's after a restore or a wrap)
_OWED_NAME = "n.nspname || '.' || c.relname"
# the first key of the advisory lock (two int4 keys: apart from the claim's one bigint) that a key build holds on its
# table's schema while it names an index there
_NAMING_LOCK = 0x6B657973  # 'keys'


def pg_create_statements(table: SourceTable, schema: str | None, name: str, sequences: list[SourceSequence],
                         table_map: dict[str, str], version: int) -> list[str]:
    """CREATE TABLE (and replica identity) statements for a PostgreSQL target of server ``version``; its keys
    (``pg_key_statements``) are left for after the copy, the table's row written in ``KEYS_OWED`` if it has any.

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
    stmts = []
    if schema:
        stmts.append(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
    stmts.append(f"CREATE TABLE {qt} (" + ", ".join(parts) + ")")
    if pg_key_statements(table, qt):
        stmts.append(f"INSERT INTO {KEYS_OWED} (table_oid, table_name) SELECT c.oid, {_OWED_NAME} FROM pg_class c "
                     f"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = {quote_literal(qt)}::regclass")
    if table.replica_identity == "f":
        stmts.append(f"ALTER TABLE {qt} REPLICA IDENTITY FULL")
    elif table.replica_identity == "n":
        stmts.append(f"ALTER TABLE {qt} REPLICA IDENTITY NOTHING")
    return stmts


def pg_key_statements(table: SourceTable, qt: str, index_name: str | None = None) -> list[str]:
    """The statements that give target table ``qt`` the source's keys: its primary key and the unique index it uses
    as replica identity (when that is not the primary key; named ``index_name``, else as on the source), each when
    every column of it is published (an insert-only publication may leave them out)."""
    stmts = []
    published = {c.name for c in table.columns}
    if table.primary_key and all(k in published for k in table.primary_key):
        stmts.append(f"ALTER TABLE {qt} ADD PRIMARY KEY (" + ", ".join(map(quote_ident, table.primary_key)) + ")")
    if (table.replica_identity == "i" and table.identity_index and table.identity_index[1] != table.primary_key
            and all(k in published for k in table.identity_index[1])):
        idx, cols = table.identity_index
        idx = index_name or idx
        stmts.append(f"CREATE UNIQUE INDEX {quote_ident(idx)} ON {qt} (" + ", ".join(map(quote_ident, cols)) + ")")
        stmts.append(f"ALTER TABLE {qt} REPLICA IDENTITY USING INDEX {quote_ident(idx)}")
    return stmts


def build_pg_keys(conn: psycopg.Connection[Any], table: SourceTable, schema: str | None, name: str) -> bool:
    """Build the keys of target table ``name`` if it owes them (its row in ``KEYS_OWED``; its copy is over), and
    delete its row, in one transaction on autocommit connection ``conn``; whether it owed them. SchemaError naming
    the table and the statement that failed (then nothing changed)."""
    qt = quoted_name(schema, name)
    owed = conn.execute(f"SELECT k.table_oid FROM {KEYS_OWED} k JOIN pg_class c ON c.oid = k.table_oid "
                        f"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s) "
                        f"AND k.table_name = {_OWED_NAME}", [qt]).fetchone()
    if owed is None:
        return False
    stmt = "BEGIN"
    try:
        with conn.transaction():
            if table.identity_index is not None:
                # builds of other tables run at once (``KeyBuilder``): one schema's index names are chosen one
                # build at a time, each seeing the names the builds before it took
                stmt = "SELECT pg_advisory_xact_lock(…)"
                conn.execute("SELECT pg_advisory_xact_lock(%s, (SELECT relnamespace::int FROM pg_class "
                             "WHERE oid = to_regclass(%s)))", [_NAMING_LOCK, qt])
            for stmt in [*pg_key_statements(table, qt, _free_index_name(conn, table, schema)),
                         f"DELETE FROM {KEYS_OWED} WHERE table_oid = {int(owed[0])}"]:
                conn.execute(stmt)
    except psycopg.Error as exc:
        raise SchemaError(f"building the keys of target table {shown_name(schema, name)} after its copy failed: "
                          f"{one_line(exc)} (in: {one_line(stmt)[:300]})") from None
    return True


def _free_index_name(conn: psycopg.Connection[Any], table: SourceTable, schema: str | None) -> str | None:
    """The name of the replica identity index of ``table`` in target ``schema``: the source's when no relation of
    the schema has it (tables of two source schemas that a table map puts in one may have indexes of one name), else
    it with the first number that makes it free; None: the table has none."""
    if table.identity_index is None:
        return None
    return _free_name(conn, schema, table.identity_index[0])


def _free_name(conn: psycopg.Connection[Any], schema: str | None, base: str, taken: set[str] | None = None) -> str | None:
    """``base`` if no relation of target ``schema`` (and nothing in ``taken``) has that name, else it with the first
    number that makes it free (cut to PostgreSQL's 63 bytes), as PostgreSQL numbers the names it chooses; None if
    a thousand are taken (the caller keeps ``base``, and its clash is named by the statement's error)."""
    for n in range(1000):
        suffix = str(n) if n else ""
        name = base.encode()[:63 - len(suffix)].decode(errors="ignore") + suffix
        if name not in (taken or ()) and conn.execute("SELECT to_regclass(%s)",
                                                      [quoted_name(schema, name)]).fetchone() == (None,):
            return name
    return None


def _new_sequences(conn: psycopg.Connection[Any], sequences: list[SourceSequence], created: set[tuple[str, str]],
                   table_map: dict[str, str]) -> list[SourceSequence]:
    """The sequences of ``sequences`` to create on the target. A sequence owned by a table created now (``created``)
    is its own: its name if free in its target schema, else the name with a number (``SourceSequence.target``; a
    table map may put tables of two source schemas, each with its ``shop_id_seq``, in one schema: sharing one
    sequence, or the second's ``CREATE`` failing, was what happened before). One owned by a table the target has
    already is the one its column there owns, whatever its name (``sync --table`` adding a table whose default calls
    it). Any other is created if its target name is free, else the existing one is used (a standalone sequence)."""
    new: list[SourceSequence] = []
    (here,) = catalog_row(conn, "SELECT current_schema()", [])  # where a name without a schema is created
    taken: dict[str | None, set[str]] = {}  # names of this run's new sequences, by target schema
    # the others' names first: theirs are fixed (the defaults that call them say so)
    for q in sorted(sequences, key=lambda q: q.owner is not None and q.owner[:2] in created):
        schema, name = target_sequence_name(q, table_map)
        mine = taken.setdefault(schema or here, set())
        if q.owner is not None and q.owner[:2] in created:
            free = _free_name(conn, schema, name, mine)
            if free is not None and free != name:
                q.target = (schema, free)
            name = free or name
        elif q.owner is not None and (owned := owned_sequence(
                conn, quoted_name(*pg_shape_table(q.owner[0], q.owner[1], table_map)), q.owner[2])) is not None:
            q.target = owned
            continue
        elif catalog_row(conn, "SELECT to_regclass(%s)", [quoted_name(schema, name)])[0] is not None:
            continue
        mine.add(name)
        new.append(q)
    chosen = {id(q) for q in new}
    return [q for q in sequences if id(q) in chosen]


def check_pg_table(conn: psycopg.Connection[Any], table: SourceTable, schema: str | None, name: str) -> list[str] | None:
    """Problems of an existing PostgreSQL target table (one line each), or None if it does not exist."""
    reg = catalog_row(conn, "SELECT to_regclass(%s)::oid", [quoted_name(schema, name)])[0]
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
    created = {(t.schema, t.name) for t in missing}
    new_seqs = _new_sequences(conn, sequences, created, table_map)
    # the names in the statements' literals ('…'::regclass) are read as written whatever the role's setting
    statements = ["SET LOCAL standard_conforming_strings = on"]
    # rows of tables dropped since they were made (their oid could be a new table's one day)
    statements.append(f"DELETE FROM {KEYS_OWED} WHERE NOT EXISTS (SELECT FROM pg_class WHERE oid = table_oid)")
    statements += type_sql
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
