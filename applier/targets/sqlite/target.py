"""The SQLite target: one ``sqlite3`` connection in WAL mode, explicit transactions.

SQLite has no schemas: a source table of schema ``public`` keeps its bare name,
any other is named ``schema.table`` as one quoted identifier (``target.tables``
maps names otherwise). Values follow the mapping in ``applier.targets.sqlite.values``.
A commit is durable when it returns (``synchronous = FULL``), so the applied
position may be confirmed to the source at once.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from applier.decoder.messages import Relation, TupleData, Type
from applier.errors import ApplyError, MissingTable
from applier.lsn import LSN
from applier.progress.store import progress_sql
from applier.targets.base import SQLITE, Binding, LocalRow, TargetBase, present_columns, source_name
from applier.targets.contract import Failures
from applier.targets.follow import ADD_COLUMNS_HINT
from applier.targets.sqlite.claim import FileClaim, sqlite_claim, sqlite_holder
from applier.targets.sqlite.naming import sqlite_target_table
from applier.targets.sqlite.values import sqlite_declared, sqlite_text_converters
from applier.text import quote_ident

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.changes import Change
    from applier.ddl.shape import TableShape
    from applier.targets.sqlite.ddl import SqliteSchemaWriter
from applier.url import Kind, parse_target_url

SQLITE_SQL = progress_sql("?", "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'applier_sync_tables'")


def is_transient(exc: BaseException) -> bool:
    """Whether a failure on a SQLite target (``exc`` or what caused it) passes by itself: the database locked by
    another process longer than the connection waits (a busy file), rather than a change it refuses."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sqlite3.OperationalError) and "locked" in str(seen):
            return True
        seen = seen.__cause__
    return False


def is_unique(exc: BaseException) -> bool:
    """An IntegrityError of a UNIQUE (or PRIMARY KEY) constraint."""
    return isinstance(exc, sqlite3.IntegrityError) and "UNIQUE constraint failed" in str(exc)


# what a failure on a SQLite target raises, and which of it passes by itself (``applier.targets.opener``)
FAILURES = Failures((sqlite3.Error,), is_transient, is_unique)


def sqlite_path(url: str) -> str:
    """The database file of a sqlite:/// URL (':memory:' for sqlite://)."""
    return parse_target_url(url).database or ":memory:"


class SqliteTarget(TargetBase):
    """Applies changes to a SQLite database file; see the module header."""

    dialect = SQLITE
    sql = SQLITE_SQL

    def __init__(self, url: str, name: str, table_map: dict[str, str] | None = None, **_: Any) -> None:
        self.url = url
        self.name = name
        self.table_map = table_map or {}
        path = sqlite_path(url)
        try:
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=60)
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = FULL")
        except sqlite3.Error as exc:
            raise ApplyError(f"cannot open the SQLite target {path}: {exc}") from None
        self.cur = self.conn.cursor()
        self.in_txn = False
        fk = self.conn.execute("PRAGMA foreign_keys").fetchone()[0]
        triggers = self.conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'trigger'").fetchone()[0]
        self.reorder_tables = not fk and not triggers
        self._durable = LSN(0)
        self.path = path
        self._claim: FileClaim | None = None
        self._schema_writer: SqliteSchemaWriter | None = None  # made at first use (``schema_writer``)

    def target_table(self, rel: Relation) -> tuple[str | None, str]:
        """(None, table) on the target for a source relation (applier.targets.naming)."""
        return sqlite_target_table(rel, self.table_map)

    @property
    def schema_writer(self) -> SqliteSchemaWriter:
        """The writer of captured schema changes (``applier.targets.sqlite.ddl``), made at first use."""
        if self._schema_writer is None:
            # start-up time: as at the top (only a schema follower asks)
            from applier.targets.sqlite.ddl import SqliteSchemaWriter

            self._schema_writer = SqliteSchemaWriter(self.conn, self.table_map)
        return self._schema_writer

    def write_ddl(self, change: Change, lsn: LSN) -> None:
        """Write one captured schema change in the open transaction (``applier.targets.sqlite.ddl``)."""
        self.schema_writer.write(change, lsn)

    def target_exists(self, shape: TableShape) -> bool:
        """Whether the target table of source table ``shape`` exists."""
        return self.schema_writer.target_exists(shape)

    def target_partitioned(self, shape: TableShape) -> bool:
        """SQLite has no partitioned tables (see ``SchemaWriter``)."""
        return False

    def target_partition_of(self, shape: TableShape, parent: TableShape) -> bool:
        """SQLite has no partitions (see ``SchemaWriter``)."""
        return False

    def follow(self, rel: Relation, types: dict[int, Type], lsn: LSN, no_ddl: str | None = None) -> None:
        """Make the target table fit ``rel`` (see ``SchemaFollower``): ADD COLUMN with the mapped declared type
        (``applier.targets.sqlite.values.sqlite_declared``). A type change needs nothing and is never refused: SQLite holds
        no value to a declared type's precision or length (the declared type only picks the column's affinity), so
        each value is stored as the source's type now gives it, under that affinity, as any value is with
        ``schema_changes = "error"``. A missing table is left to ``bind``."""
        _, table = self.target_table(rel)
        rows = self.conn.execute(f"PRAGMA table_info({quote_ident(table)})").fetchall()
        if not rows:
            return
        have = {r[1] for r in rows}
        add = [c for c in rel.columns if c.name not in have]
        declared = dict(zip((c.name for c in rel.columns), sqlite_declared(rel)))
        changes = [(f"ALTER TABLE {quote_ident(table)} ADD COLUMN {quote_ident(c.name)} {declared[c.name]}",
                    f"column {c.name!r} added as {declared[c.name]}", None) for c in add]
        sent = {c.name for c in rel.columns}
        # NOT NULL without a default, and not the rowid (INTEGER PRIMARY KEY), which SQLite fills itself
        stuck = [r[1] for r in rows if r[1] not in sent and r[3] and r[4] is None
                 and not (r[5] and r[2].upper() == "INTEGER" and sum(1 for x in rows if x[5]) == 1)]
        self.run_schema_changes(rel, repr(table), changes, stuck, lsn, no_ddl)

    def bind(self, rel: Relation, types: dict[int, Type], lsn: LSN, binary: bool = False) -> Binding:
        """Read the target table's columns and build the binding; errors name table, column and LSN."""
        _, table = self.target_table(rel)
        rows = self.conn.execute(f"PRAGMA table_info({quote_ident(table)})").fetchall()
        if not rows:
            raise MissingTable(f"target table {table!r} (for source table {source_name(rel)}) does not exist "
                               f"(at LSN {lsn})", repr(table))
        names = {r[1] for r in rows}
        for c in rel.columns:
            if c.name not in names:
                raise ApplyError(f"target table {table!r} has no column {c.name!r} that source table "
                                 f"{source_name(rel)} sends (at LSN {lsn}){ADD_COLUMNS_HINT}")
        if binary:
            # here, not at the top: start-up time (text mode never loads the binary converters)
            from applier.targets.binary import binary_converters, value_texts
            convert = binary_converters(rel, types, Kind.SQLITE, self.money_text)
        else:
            convert = sqlite_text_converters(rel)
        b = Binding(rel, table, quote_ident(table), convert, SQLITE)
        if binary:
            b.show = value_texts(rel, types)
        pk = [r for r in rows if r[5]]
        # an INTEGER PRIMARY KEY is the rowid itself: unique, though PRAGMA index_list shows no index for it
        uniques: list[frozenset[str] | None] = (
            [frozenset([pk[0][1]])] if len(pk) == 1 and pk[0][2].upper() == "INTEGER" else [])
        partial = [False] * len(uniques)
        for ix in self.conn.execute(f"PRAGMA index_list({quote_ident(table)})").fetchall():
            if ix[2]:  # unique
                cols = [r[2] for r in self.conn.execute(f"PRAGMA index_info({quote_ident(ix[1])})").fetchall()]
                uniques.append(None if None in cols else frozenset(cols))
                partial.append(bool(ix[4]))
        b.set_unique_indexes(uniques, partial)
        sql = self.conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone()
        if sql and re.search(r"\)\s*WITHOUT\s+ROWID\s*;?\s*$", sql[0] or "", re.IGNORECASE):  # rows are found by key
            keyed = [quote_ident(r[1]) for r in sorted(pk, key=lambda r: r[5])]
            b.row_id, b.row_match = tuple(keyed), " AND ".join(f"{q} = ?" for q in keyed)
        return b

    # -- conflicts (see ``ConflictProbe``): no commit timestamps, so no *_origin_differs -------------

    def is_unique_error(self, exc: BaseException) -> bool:
        """An IntegrityError of a UNIQUE (or PRIMARY KEY) constraint."""
        return is_unique(exc)

    def find_sql(self, b: Binding, where: str, limit: int) -> str:
        """rowid and the sent columns as a JSON object (a BLOB as hex: JSON holds none)."""
        pairs = ", ".join(f"'{n.replace(chr(39), chr(39) * 2)}', CASE WHEN typeof({q}) = 'blob' THEN hex({q}) "
                          f"ELSE {q} END" for n, q in zip(b.names, b.qnames))
        return f"SELECT {', '.join(b.row_id)}, json_object({pairs}) FROM {b.qtable} WHERE {where} LIMIT {limit}"

    def local_row(self, b: Binding, row: Sequence[Any]) -> LocalRow:
        """Never foreign: SQLite keeps no commit origins."""
        n = len(b.row_id)
        return LocalRow(tuple(row[:n]), row[n], None, False)

    def begin(self) -> None:
        """Open a write transaction."""
        self.cur.execute("BEGIN IMMEDIATE")
        self.in_txn = True

    def commit(self, source_lsn: LSN, commit_time: int | None = None) -> None:
        """Commit (durable on return)."""
        self.cur.execute("COMMIT")
        self.in_txn = False
        self.progress_committed(True)
        self._durable = LSN(max(self._durable, source_lsn))

    def rollback(self) -> None:
        """Roll back the open transaction, if any."""
        if self.conn.in_transaction:
            self.cur.execute("ROLLBACK")
        self.in_txn = False
        self.progress_committed(False)

    def durable_lsn(self) -> LSN:
        """The highest source LSN whose commit is on disk."""
        return self._durable

    def wait_durable(self) -> None:
        """Nothing to wait for: commits are durable when they return."""

    def insert(self, b: Binding, rows: Sequence[TupleData], lsn: LSN) -> None:
        """Insert rows, one executemany per run of rows with the same columns."""
        i = 0
        while i < len(rows):
            present = present_columns(rows[i])
            j = i + 1
            while j < len(rows) and present_columns(rows[j]) == present:
                j += 1
            self.cur.executemany(b.insert_sql(present), b.value_rows(rows[i:j], present))
            i = j

    def truncate(self, bindings: Sequence[Binding], cascade: bool, restart_identity: bool) -> None:
        """DELETE every row of the tables; RESTART IDENTITY resets their AUTOINCREMENT counters."""
        for b in bindings:
            self.cur.execute(f"DELETE FROM {b.qtable}")
        if restart_identity:
            has_seq = self.cur.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone()
            if has_seq:
                self.cur.executemany("DELETE FROM sqlite_sequence WHERE name = ?", [[b.table] for b in bindings])

    # -- the claim (applier.targets.claim) ----------------------------------------------

    def claim(self, command: str, held: bool = False) -> None:
        """Hold this progress row while this target is open (a lock file); InUseError naming the holder if taken.
        ``held``: this process holds it already (``claim.ProcessClaim``)."""
        if not held:
            self._claim = sqlite_claim(self.path, self.name, command)

    def holder(self, name: str | None = None) -> str | None:
        """Who applies to this progress row now (None: nobody); ``name``: who holds that claim key instead
        (``claim.copy_claim_name``)."""
        return sqlite_holder(self.path, name or self.name)

    def close(self) -> None:
        """Roll back anything open, close the file and give up the claim."""
        try:
            self.rollback()
        except sqlite3.Error:
            pass
        self.conn.close()
        if self._claim is not None:
            self._claim.release()
