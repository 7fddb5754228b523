"""The PostgreSQL target: psycopg 3 on one connection, explicit transactions.

Text-mode values go to the server as they came from the source (psycopg sends
a ``str`` as type unknown, so the server casts it with the column's input
function); inserts go by COPY. The applied position is written by the engine
inside the same transaction (``write_progress``) and, when the role may, the
session carries a replication origin so the target's own changes can be told
apart from replicated ones (``origin = none`` publications downstream).

Durability: with ``synchronous_commit = off`` a commit is not yet on disk when
it returns. Each commit's target WAL position is remembered with the source
LSN it carries; ``durable_lsn`` reports the highest source LSN whose commit the
target has flushed, and only that may be confirmed to the source slot.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql as psql
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import make_url

from applier.decoder.messages import Relation, TupleData, Type
from applier.lsn import LSN
from applier.progress.store import PG_SQL
from applier.target.base import POSTGRES, ApplyError, Binding, TargetBase, quote_ident, source_name

log = logging.getLogger("applier.target")

# Types without a default equality operator: compare their text form to locate a row.
_NO_EQUALITY = frozenset({"json", "xml", "point", "line", "lseg", "box", "path", "polygon", "circle"})


def libpq_dsn(url: str) -> str:
    """A SQLAlchemy postgresql URL as a libpq URI."""
    u = make_url(url).set(drivername="postgresql")
    return u.render_as_string(hide_password=False)


def _copy_escape(v: bytes) -> bytes:
    if b"\\" in v:
        v = v.replace(b"\\", b"\\\\")
    if b"\n" in v:
        v = v.replace(b"\n", b"\\n")
    if b"\r" in v:
        v = v.replace(b"\r", b"\\r")
    if b"\t" in v:
        v = v.replace(b"\t", b"\\t")
    return v


class PostgresTarget(TargetBase):
    """Applies changes to a PostgreSQL database; see the module header."""

    dialect = POSTGRES
    sql = PG_SQL

    def __init__(self, url: str, name: str, synchronous_commit: str = "off", table_map: dict[str, str] | None = None,
                 use_origin: bool = True, two_phase_mode: str = "prepare") -> None:
        self.url = url
        self.name = name
        self.table_map = table_map or {}
        try:
            self.conn = psycopg.connect(libpq_dsn(url), autocommit=True)
        except psycopg.Error as exc:
            raise ApplyError(f"cannot connect to the target: {' '.join(str(exc).split())}") from None
        self.conn.execute(psql.SQL("SET synchronous_commit = {}").format(psql.Literal(synchronous_commit)))
        try:  # as the native subscriber: user triggers and FK checks do not fire for replicated rows
            self.conn.execute("SET session_replication_role = replica")
        except psycopg.Error:
            log.info("target: role may not set session_replication_role; triggers will fire")
        self.sync = synchronous_commit
        self.cur = self.conn.cursor()
        self.in_txn = False
        self._pending: deque[tuple[LSN, LSN]] = deque()  # (target WAL end of commit, source LSN)
        self._durable = LSN(0)
        self._engine = create_engine(url)
        max_prepared = int(self.conn.execute("SHOW max_prepared_transactions").fetchone()[0])
        self.native_prepare = two_phase_mode == "prepare" and max_prepared > 0
        self.origin = f"applier_{name}"
        self.has_origin = use_origin and self._setup_origin()

    def _setup_origin(self) -> bool:
        try:
            with self.conn.transaction():
                self.conn.execute(
                    "SELECT pg_replication_origin_create(%s) WHERE pg_replication_origin_oid(%s) IS NULL",
                    [self.origin, self.origin])
            self.conn.execute("SELECT pg_replication_origin_session_setup(%s)", [self.origin])
            return True
        except psycopg.Error as exc:
            log.info("target: not using a replication origin (%s)", " ".join(str(exc).split())[:200])
            return False

    # -- relations ------------------------------------------------------------

    def target_table(self, rel: Relation) -> tuple[str | None, str]:
        """(schema, table) on the target for a source relation."""
        mapped = self.table_map.get(source_name(rel))
        if mapped:
            schema, _, table = mapped.rpartition(".")
            return (schema or None), table
        return rel.namespace or "public", rel.name

    def bind(self, rel: Relation, types: dict[int, Type], lsn: LSN, binary: bool = False) -> Binding:
        """Reflect the target table and build the binding; errors name table, column and LSN."""
        schema, table = self.target_table(rel)
        shown = f"{schema}.{table}" if schema else table
        insp = inspect(self._engine)
        if not insp.has_table(table, schema=schema):
            raise ApplyError(f"target table {shown} (for source table {source_name(rel)}) does not exist (at LSN {lsn})")
        tcols = {c["name"]: c for c in insp.get_columns(table, schema=schema)}
        for c in rel.columns:
            if c.name not in tcols:
                raise ApplyError(f"target table {shown} has no column {c.name!r} that source table "
                                 f"{source_name(rel)} sends (at LSN {lsn})")
        text_compare = [str(tcols[c.name]["type"]).lower() in _NO_EQUALITY for c in rel.columns]
        qtable = (quote_ident(schema) + "." if schema else "") + quote_ident(table)
        if binary:
            from applier.target.values import binary_converters
            convert: list[Any] = binary_converters(rel, types, "postgresql")
        else:
            convert = [bytes.decode] * len(rel.columns)
        return Binding(rel, shown, qtable, convert, POSTGRES, text_compare)

    # -- transactions ---------------------------------------------------------

    def begin(self) -> None:
        """Open a transaction."""
        self.cur.execute("BEGIN")
        self.in_txn = True

    def commit(self, source_lsn: LSN, commit_time: int | None = None) -> None:
        """Commit; remember where the commit sits in the target's WAL for ``durable_lsn``."""
        if self.has_origin and commit_time is not None:
            self.cur.execute("SELECT pg_replication_origin_xact_setup(%s, to_timestamp(%s))",
                             [str(source_lsn), commit_time / 1e6 + 946684800])
        self.cur.execute("COMMIT")
        self.in_txn = False
        if self.sync == "off":
            row = self.cur.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            self._pending.append((LSN.parse(row[0]), source_lsn))
        else:
            self._durable = LSN(max(self._durable, source_lsn))

    def rollback(self) -> None:
        """Roll back the open transaction, if any."""
        if self.conn.closed:
            return
        self.cur.execute("ROLLBACK")
        self.in_txn = False

    def durable_lsn(self) -> LSN:
        """The highest source LSN whose target commit is flushed to disk."""
        if self._pending and not self.in_txn:
            row = self.cur.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
            flushed = LSN.parse(row[0])
            while self._pending and self._pending[0][0] <= flushed:
                self._durable = LSN(max(self._durable, self._pending.popleft()[1]))
        return self._durable

    def wait_durable(self) -> None:
        """Make every commit so far durable (a commit with synchronous_commit on flushes all WAL before it)."""
        if self._pending and not self.in_txn:
            with self.conn.transaction():
                self.conn.execute("SET LOCAL synchronous_commit = on")
                self.conn.execute("SELECT pg_current_xact_id()")
            while self._pending:
                self._durable = LSN(max(self._durable, self._pending.popleft()[1]))

    # -- changes --------------------------------------------------------------

    def insert(self, b: Binding, rows: Sequence[TupleData]) -> None:
        """Insert rows with one COPY (text mode) or a pipelined executemany (binary mode)."""
        if b.convert and b.convert[0] is not bytes.decode:
            present = tuple(range(len(b.names)))
            self.cur.executemany(b.insert_sql(present), [b.values(t, present) for t in rows])
            return
        seps = len(b.names) - 1
        lines = []
        for t in rows:
            vals = t.values
            if None in vals:
                line = b"\t".join(b"\\N" if v is None else _copy_escape(v) for v in vals)
            else:
                line = b"\t".join(vals)  # type: ignore[arg-type]
                if line.count(b"\t") != seps or b"\\" in line or b"\n" in line or b"\r" in line:
                    line = b"\t".join(_copy_escape(v) for v in vals)  # type: ignore[arg-type]
            lines.append(line)
        lines.append(b"")
        with self.cur.copy(self._copy_sql(b)) as copy:
            copy.write(b"\n".join(lines))

    def _copy_sql(self, b: Binding) -> str:
        sql = b._sql.get("COPY")
        if sql is None:
            sql = b._sql["COPY"] = f"COPY {b.qtable} ({', '.join(b.qnames)}) FROM STDIN"
        return sql

    def run_many(self, sql: str, params: list[list[Any]]) -> int:
        """Execute one statement for many parameter rows (pipelined); total rows affected."""
        if len(params) == 1:
            self.cur.execute(sql, params[0])
        else:
            self.cur.executemany(sql, params)
        return self.cur.rowcount

    def truncate(self, bindings: Sequence[Binding], cascade: bool, restart_identity: bool) -> None:
        """TRUNCATE the tables, honouring CASCADE and RESTART IDENTITY."""
        sql = "TRUNCATE " + ", ".join(b.qtable for b in bindings)
        if restart_identity:
            sql += " RESTART IDENTITY"
        if cascade:
            sql += " CASCADE"
        self.cur.execute(sql)

    # -- prepared transactions ------------------------------------------------------

    def prepare(self, gid: str) -> None:
        """PREPARE TRANSACTION the open transaction as ``gid``."""
        self.cur.execute(psql.SQL("PREPARE TRANSACTION {}").format(psql.Literal(gid)))
        self.in_txn = False

    def finish_prepared(self, gid: str, commit: bool) -> None:
        """COMMIT PREPARED or ROLLBACK PREPARED ``gid``."""
        verb = "COMMIT PREPARED {}" if commit else "ROLLBACK PREPARED {}"
        self.cur.execute(psql.SQL(verb).format(psql.Literal(gid)))

    def prepared_gids(self) -> set[str]:
        """GIDs of transactions this applier has prepared on the target and not finished."""
        rows = self.conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                                 "AND starts_with(gid, %s)", [f"applier_{self.name}_"]).fetchall()
        return {r[0] for r in rows}

    def close(self) -> None:
        """Roll back anything open and close the connection."""
        try:
            if self.in_txn and not self.conn.closed:
                self.rollback()
        except psycopg.Error:
            pass
        self.conn.close()
        self._engine.dispose()
