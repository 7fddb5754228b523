"""The SQLite target's DDL writer: one captured schema change (``applier.ddl.changes``) written in the open
target transaction (``SchemaWriter.write_ddl``), and whether a source table's target table exists.

Contract:
- the target table is named by the SQLite naming rule (``applier.targets.sqlite.naming``, ``target.tables``); a
  column's declared type is the engine's mapping (``applier.targets.sqlite.values.sqlite_declared_type``);
- each change is written in the open transaction and never commits: the caller commits it with the rows around
  it, or rolls the whole transaction back when a change fails (nothing of it stays);
- CREATE TABLE: NOT NULL, the primary key, constant defaults (one SQLite evaluates as the source would: a number,
  a string, true/false, NULL, perhaps cast; any other, ``nextval(…)``, ``now()``, is left out, logged); identity
  and generated columns are plain columns (logged); plain and unique indexes on columns (expression, partial or
  non-btree indexes are skipped, logged);
- RENAME TABLE / ADD / DROP / RENAME COLUMN with ALTER TABLE where SQLite can; otherwise (a type, NOT NULL,
  default or primary key changed; a NOT NULL column without a default SQLite can use added; a column in an index
  or the key dropped) SQLite's documented table rebuild (lang_altertable.html, "Making Other Kinds Of Table
  Schema Changes"), in the open transaction: the new definition is the target's own ``CREATE TABLE`` text with
  the one change made to it, so what the target has that the source does not (columns, constraints, indexes,
  triggers) stays; then ``PRAGMA foreign_key_check`` of the table and the tables that reference it;
- a type change whose new mapped type has the affinity the target column has already writes nothing: SQLite's
  declared type only picks the affinity, values are stored alike, and ``applier sync``'s check compares
  affinities, so it agrees; a rebuild of a large table for a text that changes nothing is not worth it;
- indexes keep the source's name unless another object of the SQLite database has it (one namespace for all
  tables and indexes): then ``<target table>.<index>``; a dropped index is found by either name;
- every failure is one line naming the target table, the change (``Change.describe``), the LSN and what SQLite
  said: ``ApplyError``, or ``FinalError`` for what no retry changes (a table without columns, a rebuild with
  ``foreign_keys`` on while other tables reference the table: its DROP would fire their ON DELETE actions, and
  the pragma cannot be turned off inside a transaction).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
from applier.targets.sqlite.naming import sqlite_shape_table, sqlite_table_name
from applier.targets.sqlite.values import sqlite_affinity, sqlite_converter, sqlite_declared_type
from applier.text import one_line, quote_ident

log = logging.getLogger("applier.ddl")

DROP_COLUMN_VERSION = (3, 35, 0)  # ALTER TABLE DROP COLUMN
RENAME_COLUMN_VERSION = (3, 25, 0)  # ALTER TABLE RENAME COLUMN


class Refused(Exception):
    """What the target cannot take, in words (``final``: no retry changes it); ``write`` makes it one line."""

    def __init__(self, message: str, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


# -- SQL text: a constant default, the parts of a CREATE TABLE ---------------------------------------------------

_LITERAL = re.compile(r"^\(?'((?:[^']|'')*)'(?:::[\w .\"\[\]()]+)?\)?$", re.S)
_NUMBER = re.compile(r"^\(?(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\)?(?:::[\w .\"\[\]()]+)?$")


def sqlite_default(column: ColumnShape) -> str | None:
    """The SQLite default of a source column: the constant of its default expression as the engine would store
    it (``'a'::text`` → ``'a'``, ``true`` → ``1``), or None (no default, or one SQLite cannot evaluate)."""
    expr = (column.default or "").strip()
    if not expr or column.identity or column.generated:
        return None
    if expr.upper() == "NULL" or expr.upper().startswith("NULL::"):
        return "NULL"
    if expr in ("true", "false"):
        text = expr[0]
    elif m := _LITERAL.match(expr):
        text = m.group(1).replace("''", "'")
    elif m := _NUMBER.match(expr):
        text = m.group(1)
    else:
        return None
    try:
        value = sqlite_converter(column.type_oid)(text.encode())
    except (ValueError, TypeError, IndexError):
        return None
    if isinstance(value, bytes):
        return f"X'{value.hex()}'"
    if isinstance(value, bool | int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else ("9e999" if value > 0 else "-9e999")
    return "'" + str(value).replace("'", "''") + "'"


_TOKEN = re.compile(r"""\s*("(?:[^"]|"")*"|`(?:[^`]|``)*`|\[[^\]]*\]|'(?:[^']|'')*'|[(),]|[^\s(),"'`\[]+)""")


def _tokens(sql: str) -> list[str]:
    """The tokens of SQL text, a parenthesised group as one token."""
    out: list[str] = []
    depth, group = 0, ""
    for m in _TOKEN.finditer(sql):
        t = m.group(1)
        if depth:
            group += m.group(0)
            depth += (t == "(") - (t == ")")
            if not depth:
                out.append(group.strip())
                group = ""
        elif t == "(":
            depth, group = 1, t
        else:
            out.append(t)
    return out


def _ident(token: str) -> str:
    """An identifier token unquoted."""
    if token[:1] in "\"`" and len(token) > 1:
        return token[1:-1].replace(token[0] * 2, token[0])
    if token[:1] == "[":
        return token[1:-1]
    return token


@dataclass
class Definition:
    """A ``CREATE TABLE name (part, …) tail`` split into its top-level parts (column definitions and table
    constraints, as text) and what follows the parentheses (``WITHOUT ROWID``, ``STRICT``)."""

    parts: list[str]
    tail: str

    @classmethod
    def parse(cls, sql: str) -> Definition:
        parts: list[str] = []
        depth, cur, quote = -1, "", ""  # depth -1: in the table's name, before its parentheses
        for i, ch in enumerate(sql):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"`[":
                quote = "]" if ch == "[" else ch
            elif ch == "(":
                depth += 1
                if not depth:
                    continue
            elif ch == ")" and depth == 0:
                parts.append(cur.strip())
                return cls(parts, sql[i + 1:].strip())
            elif ch == ")":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(cur.strip())
                cur = ""
                continue
            if depth >= 0:
                cur += ch
        raise ValueError("the table's CREATE TABLE text has unbalanced parentheses")

    def sql(self, table: str) -> str:
        return f"CREATE TABLE {quote_ident(table)} ({', '.join(self.parts)}){' ' + self.tail if self.tail else ''}"

    def add_column(self, part: str) -> None:
        """Add a column definition after the last one (table constraints come after the columns)."""
        first = next((i for i, p in enumerate(self.parts) if _is_constraint(_tokens(p))), len(self.parts))
        self.parts.insert(first, part)

    def column_index(self, name: str) -> int | None:
        """The index of the part defining column ``name``."""
        for i, p in enumerate(self.parts):
            toks = _tokens(p)
            if toks and not _is_constraint(toks) and _ident(toks[0]).lower() == name.lower():
                return i
        return None


_TABLE_CONSTRAINTS = {"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN"}
_CLAUSES = {"CONSTRAINT", "PRIMARY", "NOT", "NULL", "UNIQUE", "CHECK", "DEFAULT", "COLLATE", "REFERENCES",
            "GENERATED", "AS"}


def _is_constraint(tokens: list[str]) -> bool:
    return tokens[0].upper() in _TABLE_CONSTRAINTS


def _column_clauses(part: str) -> tuple[str, list[str], list[tuple[str, list[str]]]]:
    """(name token, type tokens, [(kind, tokens)]) of a column definition: kind is the clause's first keyword
    after an optional ``CONSTRAINT name`` (PRIMARY, NOT, NULL, DEFAULT, …)."""
    toks = _tokens(part)
    name, rest = toks[0], toks[1:]
    i = 0
    while i < len(rest) and rest[i].upper() not in _CLAUSES:
        i += 1
    typ = rest[:i]
    clauses: list[tuple[str, list[str]]] = []
    prev = ""
    while i < len(rest):
        t, up = rest[i], rest[i].upper()
        starts = up in _CLAUSES and prev not in ("SET", "NOT") and not (up == "NOT" and i + 1 < len(rest)
                                                                      and rest[i + 1].upper() != "NULL")
        if starts and (not clauses or clauses[-1][0] != "CONSTRAINT" or len(clauses[-1][1]) > 2):
            clauses.append((up, [t]))
            if up == "CONSTRAINT" and i + 1 < len(rest):
                i += 1
                clauses[-1][1].append(rest[i])
        elif starts and clauses[-1][0] == "CONSTRAINT":  # ``CONSTRAINT name <clause>``: the clause's kind
            clauses[-1] = (up, clauses[-1][1] + [t])
        elif clauses:
            clauses[-1][1].append(t)
        else:
            typ.append(t)
        prev = up
        i += 1
    return name, typ, clauses


def _column_part(name: str, typ: list[str], clauses: list[tuple[str, list[str]]]) -> str:
    return " ".join([name, *typ, *(" ".join(c) for _, c in clauses)])


def _mentions(part: str, column: str) -> bool:
    """Whether a table constraint names ``column``."""
    return any(_ident(t).lower() == column.lower() or (t.startswith("(") and _mentions(t[1:-1], column))
               for t in _tokens(part))


# -- the writer ------------------------------------------------------------------------------------------------------

class SqliteSchemaWriter:
    """Writes captured schema changes on one SQLite connection (``SqliteTarget.write_ddl``); see the header."""

    def __init__(self, conn: sqlite3.Connection, table_map: dict[str, str]) -> None:
        self.conn = conn
        self.table_map = table_map
        self.version = sqlite3.sqlite_version_info

    def target_exists(self, shape: TableShape) -> bool:
        """Whether the target table of source table ``shape`` exists."""
        return self._table_sql(sqlite_shape_table(shape, self.table_map)) is not None

    def write(self, change: Change, lsn: LSN) -> None:
        """Write ``change`` in the open transaction; a one-line ApplyError/FinalError (the caller rolls back)."""
        table = sqlite_shape_table(change.table, self.table_map)
        try:
            self._write(change, table)
        except (Refused, sqlite3.Error, ValueError) as exc:
            error = FinalError if isinstance(exc, Refused) and exc.final else ApplyError
            raise error(f"target table {table!r}: {change.describe()} at LSN {lsn}: {one_line(exc)}") from None

    def _write(self, change: Change, table: str) -> None:  # noqa: C901 - one branch per kind of change
        q = quote_ident(table)
        if isinstance(change, CreateTable):
            self._create_table(change.table, table)
        elif isinstance(change, DropTable):
            self.conn.execute(f"DROP TABLE {q}")
        elif isinstance(change, RenameTable):
            old = sqlite_table_name(change.old_schema, change.old_name, self.table_map)
            if old != table:
                self.conn.execute(f"ALTER TABLE {quote_ident(old)} RENAME TO {q}")
        elif isinstance(change, AddColumn):
            self._add_column(table, change.column)
        elif isinstance(change, DropColumn):
            self._drop_column(table, change.column.name)
        elif isinstance(change, RenameColumn):
            if self.version < RENAME_COLUMN_VERSION:
                raise Refused(f"SQLite {sqlite3.sqlite_version} cannot rename a column (3.25 can)", final=True)
            self.conn.execute(f"ALTER TABLE {q} RENAME COLUMN {quote_ident(change.old)} TO {quote_ident(change.new)}")
        elif isinstance(change, AlterType):
            self._alter_type(table, change.column)
        elif isinstance(change, SetNotNull):
            self._set_not_null(table, change.column)
        elif isinstance(change, SetDefault):
            self._set_default(table, change.column)
        elif isinstance(change, SetPrimaryKey):
            self._set_primary_key(table, change.table.primary_key)
        elif isinstance(change, CreateIndex):
            self._create_index(table, change.index)
        elif isinstance(change, DropIndex):
            self._drop_index(table, change.index)
        elif isinstance(change, SetReplicaIdentity):
            log.debug("%s: nothing to write on SQLite (no replica identity)", change.describe())
        else:  # pragma: no cover - every kind of change is above
            raise Refused(f"unknown change {type(change).__name__}", final=True)

    # -- CREATE TABLE --------------------------------------------------------------------------------------------

    def _column_sql(self, table: str, column: ColumnShape, with_not_null: bool = True) -> str:
        """A column definition: the mapped declared type, NOT NULL, a constant default (others logged)."""
        s = f"{quote_ident(column.name)} {sqlite_declared_type(column.type_oid)}"
        if with_not_null and column.not_null:
            s += " NOT NULL"
        default = sqlite_default(column)
        if default is not None:
            s += f" DEFAULT {default}"
        if column.identity or column.generated:
            log.info("target table %r: column %r is %s on the source, a plain column on SQLite", table, column.name,
                     f"generated as {column.generated}" if column.generated else "an identity")
        elif column.default and default is None:
            log.info("target table %r: column %r gets no default: SQLite cannot evaluate the source's %s", table,
                     column.name, column.default)
        return s

    def _create_table(self, shape: TableShape, table: str) -> None:
        if not shape.columns:
            raise Refused("a SQLite table needs at least one column", final=True)
        parts = [self._column_sql(table, c) for c in shape.columns]
        if shape.primary_key:
            parts.append("PRIMARY KEY (" + ", ".join(map(quote_ident, shape.primary_key)) + ")")
        self.conn.execute(f"CREATE TABLE {quote_ident(table)} ({', '.join(parts)})")
        for index in shape.indexes:
            if not index.primary:
                self._create_index(table, index)

    # -- columns ---------------------------------------------------------------------------------------------------

    def _add_column(self, table: str, column: ColumnShape) -> None:
        part = self._column_sql(table, column)
        if not column.not_null or sqlite_default(column) not in (None, "NULL"):
            self._need_table(table)
            self.conn.execute(f"ALTER TABLE {quote_ident(table)} ADD COLUMN {part}")
            return
        # NOT NULL without a default SQLite can use: ALTER TABLE refuses it, the rebuild takes it on an empty table
        rows = self.conn.execute(f"SELECT count(*) FROM {quote_ident(table)}").fetchone()[0]
        if rows:
            raise Refused(f"column {column.name!r} is NOT NULL without a default SQLite can use, and the table holds "
                          f"{rows} row(s) that would have NULL in it")
        self._rebuild(table, lambda d: d.add_column(part))

    def _drop_column(self, table: str, column: str) -> None:
        d = self._definition(table)
        if d.column_index(column) is None:
            raise Refused(f"no such column: {column!r}")
        keyed = any(r[1] == column and r[5] for r in self._xinfo(table))
        if self.version >= DROP_COLUMN_VERSION and not keyed and not self._indexes_of(table, column):
            self.conn.execute(f"ALTER TABLE {quote_ident(table)} DROP COLUMN {quote_ident(column)}")
            return

        def edit(d: Definition) -> None:
            i = d.column_index(column)
            assert i is not None
            del d.parts[i]
            # as PostgreSQL drops the constraints that involve a dropped column
            d.parts[:] = [p for p in d.parts if not (_is_constraint(_tokens(p)) and _mentions(p, column))]
        self._rebuild(table, edit, dropped=column)

    def _edit_column(self, table: str, column: str, change: Callable[[list[str], list[tuple[str, list[str]]]],
                                                                       tuple[list[str], list[tuple[str, list[str]]]]]
                     ) -> None:
        """Rebuild ``table`` with column ``column``'s definition changed by ``change(type, clauses)``."""
        def edit(d: Definition) -> None:
            i = d.column_index(column)
            if i is None:
                raise Refused(f"no such column: {column!r}")
            name, typ, clauses = _column_clauses(d.parts[i])
            d.parts[i] = _column_part(name, *change(typ, clauses))
        self._rebuild(table, edit)

    def _column(self, table: str, column: str) -> tuple[str, bool, str | None, int]:
        """(declared type, NOT NULL, default, position in the key) of a target column; Refused if it is missing."""
        for r in self._xinfo(table):
            if r[1] == column:
                return r[2], bool(r[3]), r[4], r[5]
        raise Refused(f"no such column: {column!r}")

    def _alter_type(self, table: str, column: ColumnShape) -> None:
        declared = sqlite_declared_type(column.type_oid)
        have = self._column(table, column.name)[0]
        if sqlite_affinity(have) == sqlite_affinity(declared):
            log.debug("target table %r: column %r keeps its declared type %s (the affinity of %s)", table,
                      column.name, have, column.type)
            return
        self._edit_column(table, column.name, lambda typ, clauses: ([declared], clauses))

    def _set_not_null(self, table: str, column: ColumnShape) -> None:
        if self._column(table, column.name)[1] == column.not_null:
            return
        if column.not_null:
            nulls = self.conn.execute(f"SELECT count(*) FROM {quote_ident(table)} WHERE {quote_ident(column.name)} "
                                      f"IS NULL").fetchone()[0]
            if nulls:
                raise Refused(f"column {column.name!r} holds NULL in {nulls} row(s)")
        extra = [("NOT", ["NOT", "NULL"])] if column.not_null else []
        self._edit_column(table, column.name, lambda typ, clauses: (
            typ, [c for c in clauses if c[0] not in ("NOT", "NULL")] + extra))

    def _set_default(self, table: str, column: ColumnShape) -> None:
        default = sqlite_default(column)
        if column.default and default is None and not (column.identity or column.generated):
            log.info("target table %r: column %r gets no default: SQLite cannot evaluate the source's %s", table,
                     column.name, column.default)
        if self._column(table, column.name)[2] == default:
            return
        extra = [("DEFAULT", ["DEFAULT", default])] if default is not None else []
        self._edit_column(table, column.name, lambda typ, clauses: (
            typ, [c for c in clauses if c[0] != "DEFAULT"] + extra))

    def _set_primary_key(self, table: str, key: Sequence[str]) -> None:
        have = [r[1] for r in sorted((r for r in self._xinfo(table) if r[5]), key=lambda r: r[5])]
        if have == list(key):
            return

        def edit(d: Definition) -> None:
            parts = []
            for p in d.parts:
                toks = _tokens(p)
                if _is_constraint(toks):
                    if not any(t.upper() == "PRIMARY" for t in toks[:3]):
                        parts.append(p)
                    continue
                name, typ, clauses = _column_clauses(p)
                parts.append(_column_part(name, typ, [c for c in clauses if c[0] != "PRIMARY"]))
            if key:
                parts.append("PRIMARY KEY (" + ", ".join(map(quote_ident, key)) + ")")
            d.parts[:] = parts
        self._rebuild(table, edit)

    # -- indexes ---------------------------------------------------------------------------------------------------

    def _create_index(self, table: str, index: IndexShape) -> None:
        definition = index.definition
        why = ("it is on expressions" if index.columns is None
               else "it is partial" if re.search(r"\)\s+WHERE\s", definition)
               else "it is not a btree index" if " USING " in definition and " USING btree " not in definition
               else None)
        if why:
            log.info("target table %r: index %r not created on SQLite: %s (%s)", table, index.name, why, definition)
            return
        assert index.columns is not None
        name = index.name
        if self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ? COLLATE NOCASE", [name]).fetchone():
            name = f"{table}.{index.name}"
        self.conn.execute(f"CREATE {'UNIQUE ' if index.unique else ''}INDEX {quote_ident(name)} ON "
                          f"{quote_ident(table)} ({', '.join(map(quote_ident, index.columns))})")

    def _drop_index(self, table: str, index: IndexShape) -> None:
        for name in (index.name, f"{table}.{index.name}"):
            if self.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ? AND tbl_name = ?",
                                 [name, table]).fetchone():
                self.conn.execute(f"DROP INDEX {quote_ident(name)}")
                return
        log.info("target table %r: no index %r to drop (never created on SQLite)", table, index.name)

    # -- the rebuild (lang_altertable.html, "Making Other Kinds Of Table Schema Changes") ---------------------------

    def _rebuild(self, table: str, edit: Callable[[Definition], None], dropped: str | None = None) -> None:
        """Rebuild ``table`` with its definition changed by ``edit``, in the open transaction; ``dropped``: a column
        that goes, with the indexes on it (as PostgreSQL drops them)."""
        d = self._definition(table)
        edit(d)
        q = quote_ident(table)
        if self.conn.execute("PRAGMA foreign_keys").fetchone()[0] and self._referencing(table):
            raise Refused(f"foreign_keys is on and {', '.join(map(repr, self._referencing(table)))} reference(s) the "
                          f"table: dropping it in the rebuild would fire their ON DELETE actions, and the pragma "
                          f"cannot be turned off inside a transaction; turn foreign_keys off on this target",
                          final=True)
        old_cols = {r[1] for r in self._xinfo(table) if r[6] in (0, 1)}
        others = self.conn.execute("SELECT type, name, sql FROM sqlite_master WHERE tbl_name = ? AND type IN "
                                   "('index', 'trigger') AND sql IS NOT NULL", [table]).fetchall()
        gone = self._indexes_of(table, dropped) if dropped else set()
        keep = [sql for kind, name, sql in others if not (kind == "index" and name in gone)]
        for name in sorted(gone):
            log.info("target table %r: index %r dropped with column %r", table, name, dropped)
        new = f"applier_new_{table}"
        self.conn.execute(d.sql(new))
        new_cols = [r[1] for r in self.conn.execute(f"PRAGMA table_xinfo({quote_ident(new)})") if r[6] in (0, 1)]
        cols = ", ".join(quote_ident(c) for c in new_cols if c in old_cols)
        self.conn.execute(f"INSERT INTO {quote_ident(new)} ({cols}) SELECT {cols} FROM {q}")
        legacy = self.conn.execute("PRAGMA legacy_alter_table").fetchone()[0]
        self.conn.execute("PRAGMA legacy_alter_table = ON")  # views and triggers naming the table stay as they are
        try:
            self.conn.execute(f"DROP TABLE {q}")
            self.conn.execute(f"ALTER TABLE {quote_ident(new)} RENAME TO {q}")
        finally:
            self.conn.execute(f"PRAGMA legacy_alter_table = {'ON' if legacy else 'OFF'}")
        for sql in keep:
            self.conn.execute(sql)
        for t in [table, *self._referencing(table)]:
            bad = self.conn.execute(f"PRAGMA foreign_key_check({quote_ident(t)})").fetchone()
            if bad:
                raise Refused(f"foreign key violated after the rebuild: table {bad[0]!r} rowid {bad[1]} references "
                              f"{bad[2]!r}")

    # -- the target's catalog ----------------------------------------------------------------------------------------

    def _table_sql(self, table: str) -> str | None:
        row = self.conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone()
        return None if row is None else str(row[0])

    def _need_table(self, table: str) -> None:
        if self._table_sql(table) is None:
            raise Refused("no such table")

    def _definition(self, table: str) -> Definition:
        sql = self._table_sql(table)
        if sql is None:
            raise Refused("no such table")
        return Definition.parse(sql)

    def _xinfo(self, table: str) -> list[tuple[int, str, str, int, str | None, int, int]]:
        return self.conn.execute(f"PRAGMA table_xinfo({quote_ident(table)})").fetchall()

    def _indexes_of(self, table: str, column: str) -> set[str]:
        """The indexes of ``table`` that name ``column`` (or are on expressions that may)."""
        out = set()
        for ix in self.conn.execute(f"PRAGMA index_list({quote_ident(table)})").fetchall():
            cols = [r[2] for r in self.conn.execute(f"PRAGMA index_info({quote_ident(ix[1])})").fetchall()]
            sql = self.conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", [ix[1]]).fetchone()
            if column in cols or (None in cols and sql and sql[0] and _mentions(sql[0], column)):
                out.add(str(ix[1]))
        return out

    def _referencing(self, table: str) -> list[str]:
        """The other tables whose foreign keys reference ``table``."""
        names = [r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name <> ?",
                                                 [table])]
        return [n for n in names if any(str(fk[2]).lower() == table.lower() for fk in
                                        self.conn.execute(f"PRAGMA foreign_key_list({quote_ident(n)})"))]
