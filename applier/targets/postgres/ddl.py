"""Captured schema changes written to a PostgreSQL target (``PostgresTarget.write_ddl`` / ``target_exists``).

``DdlWriter.write(change, lsn)`` turns one ``applier.ddl.changes.Change`` into statements on the target table the
naming rule gives (``pg_shape_table``: ``target.tables`` or the source's schema and name) and runs them in the open
transaction: it never commits, the engine commits them with the rows around them.

Invariants:
- every statement runs under ``LOCK_TIMEOUT`` (the session's own lock_timeout is put back after): a lock not
  granted is an ApplyError, retried by the runner, never a hang;
- a failure is one line: target table, ``change.describe()``, LSN, the server's message; a FinalError when retrying
  cannot help (a type or object the target lacks, a table that exists and differs); the caller rolls back;
- names are quoted (``quote_ident``); a value goes as a parameter or a quoted literal, never formatted in;
- a default that is not a constant (``nextval('seq')``, a user function) is left out, with a log line: the target
  may lack what it calls, and the replicated rows carry their values anyway.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import psycopg

from applier.ddl.changes import (
    AddColumn,
    AlterType,
    Change,
    CreateIndex,
    CreateTable,
    DropColumn,
    DropIndex,
    DropTable,
    RenameColumn,
    RenameTable,
    SetDefault,
    SetNotNull,
    SetPrimaryKey,
    SetReplicaIdentity,
)
from applier.ddl.shape import ColumnShape, IndexShape, TableShape
from applier.errors import ApplyError, FinalError
from applier.lsn import LSN
from applier.targets.postgres.naming import pg_shape_table
from applier.text import one_line, quote_ident

log = logging.getLogger("applier.targets")

LOCK_TIMEOUT = "10s"  # how long one DDL statement waits for its lock before it fails (and is retried)
FIRST_USER_OID = 16384  # a type OID below this is built in: the same name on every server
SET_EXPRESSION_VERSION = 170000  # ALTER COLUMN … SET EXPRESSION exists from PostgreSQL 17

# SQLSTATEs that no retry mends: undefined object/table/column/function, feature not supported, duplicate table
_FINAL = ("42704", "42P01", "42703", "42883", "0A000", "42P07")
# a constant default: a literal (number, quoted string, true/false/NULL), perhaps in parentheses, perhaps cast
_CONSTANT = re.compile(r"""^\(*\s*(-?[0-9][0-9.eE+-]*|'(?:[^']|'')*'|true|false|NULL)\s*\)*"""
                       r"""(::[A-Za-z_][A-Za-z0-9_ ."]*(\([0-9, ]*\))?(\[\])*)*$""")
_INDEX = re.compile(r"^(CREATE (?:UNIQUE )?INDEX) (?:\S+|\"(?:[^\"]|\"\")*\") ON (?:ONLY )?"
                    r"(?:\S+|\"(?:[^\"]|\"\")*\") (USING .*)$", re.S)


def qualified(schema: str | None, table: str) -> str:
    """The quoted name of a target table (schema None: found through the search path)."""
    return (quote_ident(schema) + "." if schema else "") + quote_ident(table)


def constant(default: str | None) -> bool:
    """Whether a default expression is a constant (kept on the target; others are left out)."""
    return default is not None and _CONSTANT.match(default.strip()) is not None


def column_type(c: ColumnShape) -> str:
    """A column's type on the target: ``format_type`` of a built-in type, the user type by quoted schema.name."""
    if c.type_oid < FIRST_USER_OID or not c.type_name:
        return c.type
    schema, _, name = c.type_name.rpartition(".")
    return qualified(schema or None, name)


class DdlWriter:
    """Writes captured changes on one PostgreSQL connection; ``table_map`` is ``target.tables``."""

    def __init__(self, conn: psycopg.Connection[Any], table_map: dict[str, str]) -> None:
        self.conn = conn
        self.table_map = table_map

    def target_of(self, schema: str, name: str) -> tuple[str | None, str]:
        """(schema or None, table) of the target table of source table ``schema.name``."""
        return pg_shape_table(schema, name, self.table_map)

    def exists(self, shape: TableShape) -> bool:
        """Whether the target table of ``shape`` exists."""
        row = self.conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                [qualified(*self.target_of(shape.schema, shape.name))]).fetchone()
        return bool(row and row[0])

    def partitioned(self, shape: TableShape) -> bool:
        """Whether the target table of ``shape`` is a partitioned table."""
        row = self.conn.execute("SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass(%s) AND relkind = 'p')",
                                [qualified(*self.target_of(shape.schema, shape.name))]).fetchone()
        return bool(row and row[0])

    def partition_of(self, shape: TableShape, parent: TableShape) -> bool:
        """Whether the target table of ``shape`` is a partition of the target table of ``parent``."""
        row = self.conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relispartition "
            "AND i.inhrelid = to_regclass(%s) AND i.inhparent = to_regclass(%s))",
            [qualified(*self.target_of(shape.schema, shape.name)),
             qualified(*self.target_of(parent.schema, parent.name))]).fetchone()
        return bool(row and row[0])

    def write(self, change: Change, lsn: LSN) -> None:
        """Write ``change`` in the open transaction; an ApplyError (FinalError) in one line when it fails."""
        schema, table = self.target_of(change.table.schema, change.table.name)
        label = f"{schema}.{table}" if schema else table
        try:
            before = self.conn.execute("SELECT current_setting('lock_timeout')").fetchone()
            self.conn.execute("SELECT set_config('lock_timeout', %s, true)", [LOCK_TIMEOUT])
            self._write(change, schema, table, label, lsn)
            self.conn.execute("SELECT set_config('lock_timeout', %s, true)", [before[0] if before else "0"])
        except psycopg.Error as exc:
            cls = FinalError if exc.sqlstate in _FINAL else ApplyError
            said = one_line(exc.diag.message_primary or exc)  # the server's message, without its LINE/caret lines
            raise cls(f"target table {label}: {change.describe()} at LSN {lsn}: {said}") from None
        except _Refused as exc:
            raise FinalError(f"target table {label}: {change.describe()} at LSN {lsn}: {exc}") from None

    def _run(self, statement: str, params: list[Any] | None = None) -> None:
        self.conn.execute(statement.encode(), params)

    def _write(self, change: Change, schema: str | None, table: str, label: str, lsn: LSN) -> None:
        qt = qualified(schema, table)
        match change:
            case CreateTable():
                self._create(change.table, schema, table, label, lsn, change.parent)
            case DropTable():
                if self._exists(qt):
                    self._run(f"DROP TABLE {qt}")
                else:
                    log.info("target table %s: %s at LSN %s: not there, nothing to do", label, change.describe(), lsn)
            case RenameTable():
                self._rename(change, schema, table)
            case AddColumn():
                self._run(f"ALTER TABLE {qt} ADD COLUMN {self._column(change.column, label, lsn)}")
            case DropColumn():
                self._run(f"ALTER TABLE {qt} DROP COLUMN {quote_ident(change.column.name)}")
            case RenameColumn():
                self._run(f"ALTER TABLE {qt} RENAME COLUMN {quote_ident(change.old)} TO {quote_ident(change.new)}")
            case AlterType():
                c, t = quote_ident(change.column.name), column_type(change.column)
                self._run(f"ALTER TABLE {qt} ALTER COLUMN {c} TYPE {t} USING {c}::{t}")
            case SetNotNull():
                self._run(f"ALTER TABLE {qt} ALTER COLUMN {quote_ident(change.column.name)} "
                          f"{'SET' if change.column.not_null else 'DROP'} NOT NULL")
            case SetDefault():
                self._set_default(change, qt, label, lsn)
            case SetPrimaryKey():
                self._set_primary_key(change, qt)
            case CreateIndex():
                self._create_index(change.index, schema, qt, label, lsn)
            case DropIndex():
                index = self._target_index(change.index, change.table, schema, qt)  # never another table's
                if index is not None:
                    self._run(f"DROP INDEX {index[0]}")
                else:
                    log.info("target table %s: %s at LSN %s: no such index, nothing to do", label,
                             change.describe(), lsn)
            case SetReplicaIdentity():
                self._replica_identity(change.table, schema, qt)
            case _:
                raise _Refused(f"this target cannot write a {type(change).__name__}")

    def _exists(self, quoted: str) -> bool:
        row = self.conn.execute("SELECT to_regclass(%s) IS NOT NULL", [quoted]).fetchone()
        return bool(row and row[0])

    def _column(self, c: ColumnShape, label: str, lsn: LSN) -> str:
        """A column definition: name, type, default/identity/generation, NOT NULL."""
        out = f"{quote_ident(c.name)} {column_type(c)}"
        if c.generated is not None:
            out += f" GENERATED ALWAYS AS ({c.generated}) STORED"
        elif c.identity:
            out += f" GENERATED {'ALWAYS' if c.identity == 'a' else 'BY DEFAULT'} AS IDENTITY"
        elif constant(c.default):
            out += f" DEFAULT {c.default}"
        elif c.default is not None:
            log.info("target table %s at LSN %s: column %r keeps no default (%s is not a constant)", label, lsn,
                     c.name, c.default)
        return out + (" NOT NULL" if c.not_null else "")

    def _create(self, shape: TableShape, schema: str | None, table: str, label: str, lsn: LSN,
                parent: TableShape | None = None) -> None:
        qt = qualified(schema, table)
        if self._exists(qt):
            have = [(str(r[0]), str(r[1])) for r in self.conn.execute(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = to_regclass(%s)"
                " AND attnum > 0 AND NOT attisdropped ORDER BY attnum", [qt])]
            want = [(c.name, c.type) for c in shape.columns]
            if have != want:
                raise _Refused(f"the table exists and differs: it has columns "
                               f"({', '.join(f'{n} {t}' for n, t in have)}), the source's has "
                               f"({', '.join(f'{n} {t}' for n, t in want)})")
            log.info("target table %s at LSN %s: already exists with the same columns, left as it is", label, lsn)
            return
        if schema:
            self._run(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
        if parent is not None and shape.partition_bound:
            # a partition: columns, key and the parent's indexes come from the parent (as the source's did)
            self._run(f"CREATE TABLE {qt} PARTITION OF {qualified(*self.target_of(parent.schema, parent.name))} "
                      f"{shape.partition_bound}")
            if shape.replica_identity != "d":
                self._replica_identity(shape, schema, qt)
            return
        parts = [self._column(c, label, lsn) for c in shape.columns]
        if shape.primary_key:
            parts.append(self._primary_key(shape, schema))
        self._run(f"CREATE TABLE {qt} ({', '.join(parts)})")
        for ix in shape.indexes:
            if not ix.primary:
                self._create_index(ix, schema, qt, label, lsn)
        if shape.replica_identity != "d":
            self._replica_identity(shape, schema, qt)

    def _rename(self, change: RenameTable, schema: str | None, table: str) -> None:
        old_schema, old_table = self.target_of(change.old_schema, change.old_name)
        if (old_schema, old_table) == (schema, table):
            return
        if old_table != table:
            self._run(f"ALTER TABLE {qualified(old_schema, old_table)} RENAME TO {quote_ident(table)}")
        if schema and schema != old_schema:
            self._run(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
            self._run(f"ALTER TABLE {qualified(old_schema, table)} SET SCHEMA {quote_ident(schema)}")

    def _set_default(self, change: SetDefault, qt: str, label: str, lsn: LSN) -> None:
        c, old = change.column, change.old
        alter = f"ALTER TABLE {qt} ALTER COLUMN {quote_ident(c.name)}"
        if old.identity and not c.identity:
            self._run(f"{alter} DROP IDENTITY IF EXISTS")
        if old.generated is not None and c.generated is None:
            self._run(f"{alter} DROP EXPRESSION IF EXISTS")
        if c.identity:
            how = "ALWAYS" if c.identity == "a" else "BY DEFAULT"
            self._run(f"{alter} SET GENERATED {how}" if old.identity else f"{alter} ADD GENERATED {how} AS IDENTITY")
        elif c.generated is not None:
            if self.conn.info.server_version < SET_EXPRESSION_VERSION:
                raise _Refused(f"PostgreSQL {self.conn.info.server_version // 10000} cannot change a generation "
                               f"expression (SET EXPRESSION needs 17)")
            self._run(f"{alter} SET EXPRESSION AS ({c.generated})")
        elif constant(c.default):
            self._run(f"{alter} SET DEFAULT {c.default}")
        elif c.default is None:
            self._run(f"{alter} DROP DEFAULT")
        else:
            log.info("target table %s at LSN %s: column %r keeps no default (%s is not a constant)", label, lsn,
                     c.name, c.default)
            self._run(f"{alter} DROP DEFAULT")

    def _set_primary_key(self, change: SetPrimaryKey, qt: str) -> None:
        row = self.conn.execute("SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(%s) AND contype = 'p'",
                                [qt]).fetchone()
        if row is not None:
            self._run(f"ALTER TABLE {qt} DROP CONSTRAINT {quote_ident(str(row[0]))}")
        if change.table.primary_key:
            schema = self.target_of(change.table.schema, change.table.name)[0]
            self._run(f"ALTER TABLE {qt} ADD {self._primary_key(change.table, schema)}")

    def _primary_key(self, shape: TableShape, schema: str | None) -> str:
        """The primary key clause, its constraint named as the source's key index (a replica identity USING INDEX
        names it) unless that name is taken in the target schema (then the server names it)."""
        cols = f"PRIMARY KEY ({', '.join(map(quote_ident, shape.primary_key))})"
        name = next((i.name for i in shape.indexes if i.primary), None)
        if name is None or self._exists(qualified(schema, name)):
            return cols
        return f"CONSTRAINT {quote_ident(name)} {cols}"

    def _create_index(self, ix: IndexShape, schema: str | None, qt: str, label: str, lsn: LSN) -> None:
        m = _INDEX.match(ix.definition)
        if m is None:
            raise _Refused(f"index {ix.name!r}: cannot read its definition {ix.definition!r}")
        name = quote_ident(ix.name)
        if self._exists(qualified(schema, ix.name)):
            log.info("target table %s at LSN %s: index name %r is taken in the target schema; the server names "
                     "the index", label, lsn, ix.name)
            name = ""
        self._run(f"{m.group(1)} {name + ' ' if name else ''}ON {qt} {m.group(2)}")

    def _replica_identity(self, shape: TableShape, schema: str | None, qt: str) -> None:
        ri = shape.replica_identity
        if ri == "i" and shape.replica_identity_index:
            name = shape.replica_identity_index
            source = next((i for i in shape.indexes if i.name == name), None)
            found = self._target_index(source, shape, schema, qt) if source is not None else None
            # USING INDEX takes the index's own name (it is in the table's schema)
            self._run(f"ALTER TABLE {qt} REPLICA IDENTITY USING INDEX {quote_ident(found[1] if found else name)}")
        else:
            self._run(f"ALTER TABLE {qt} REPLICA IDENTITY {dict(n='NOTHING', f='FULL').get(ri, 'DEFAULT')}")

    def _target_index(self, index: IndexShape, shape: TableShape, schema: str | None,
                      qt: str) -> tuple[str, str] | None:
        """The target index (its name as a relation, qualified where the search path needs it, and its own name)
        of source index ``index`` of ``shape`` on target table ``qt``, or None: the table's index of the same name;
        else, only when that name is taken in the target schema by another relation (a table that a table map put
        beside this one: ``_create_index`` and ``_primary_key`` let the server name this table's then), the table's
        oldest valid index of the same definition (``USING …``: method, columns, order, INCLUDE, WHERE) and kind
        that bears no name of another of the source table's indexes. Never another table's index of the same name."""
        row = self.conn.execute("SELECT i.oid::regclass::text FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
                                "WHERE x.indrelid = to_regclass(%s) AND i.relname = %s", [qt, index.name]).fetchone()
        if row is not None:
            return str(row[0]), index.name
        m = _INDEX.match(index.definition)
        if m is None or not self._exists(qualified(schema, index.name)):
            return None
        others = [i.name for i in shape.indexes if i.name != index.name]
        # definitions as capture reads them (search_path pg_catalog: names outside it qualified), then the
        # session's search path back for the statements that follow
        path = self.conn.execute("SELECT current_setting('search_path')").fetchone()
        self.conn.execute("SELECT set_config('search_path', 'pg_catalog', true)")
        try:
            rows = self.conn.execute(
                "SELECT i.oid::regclass::text, i.relname, pg_get_indexdef(x.indexrelid) FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indrelid = to_regclass(%s) AND x.indisvalid "
                "AND x.indisprimary = %s AND x.indisunique = %s AND NOT i.relname = ANY(%s) ORDER BY x.indexrelid",
                [qt, index.primary, index.unique, others]).fetchall()
        finally:
            self.conn.execute("SELECT set_config('search_path', %s, true)", [path[0] if path else ""])
        for relation, name, definition in rows:
            found = _INDEX.match(definition)
            if found is not None and found.group(2) == m.group(2):
                return str(relation), str(name)
        return None


class _Refused(Exception):
    """A change this writer will not write as it stands (the message says why); a FinalError to the caller."""

