"""The initial copy: the library function behind ``applier sync``.

``sync(cfg)`` makes a target that ``applier run`` / ``catchup`` can follow from
the very next source transaction:

1. control tables migrated (as ``applier init``), among them ``applier_sync`` (one
   row per ``apply.name``: state, run id, slot, consistent point, times),
   ``applier_sync_parts`` (finished partitions of the current run) and
   ``applier_sync_tables`` (tables joined later by ``sync --table``,
   ``applier.migrate.add_table``: cleared when a run starts);
2. published tables read from the source catalog; the target's existing tables
   checked (every mismatch reported by table and column, nothing written) and
   the missing ones created (``applier.migrate.schema``; on PostgreSQL without their keys, which step 5 builds);
3. the sync row set to ``copying`` with a new run id;
4. the slot created on a replication connection with ``SNAPSHOT 'export'``: its
   consistent point C and an exported snapshot that sees exactly the
   transactions committed before C. The connection stays open, idle, until the
   copy is over (the snapshot lives as long as it does);
5. every published table copied in ctid-range partitions reading in that snapshot
   (``applier.migrate.spark.copy``: Spark tasks streaming COPY from the source into a
   PostgreSQL target, binary where safe, or the driver itself on a local master for a table of
   at most ``DRIVER_PAGES``, or for every table where the master copies one stream at a time
   (``by_spark``); the driver's readers and one writer for a
   SQLite target), with its column list and row filter, its own rows only
   (``SourceTable.only``); a table without columns as its row count. Once a
   table is copied, the keys its creation left out (``Backend.keys_after_copy``:
   primary key, replica identity index) are built, while the next tables copy
   (``KeyBuilder``). A table that cannot be copied (or keyed) does not stop the
   others: sync then fails listing every failed table with its cause;
6. in one durable target transaction: the progress row of ``apply.name`` set to
   C (and any pending skip cleared), the sync row set to ``done``, and, when DDL
   capture is installed in the snapshot, each copied table's shape at C
   (``applier_ddl.describe`` read in the snapshot) kept in ``applier_ddl_tables``
   in place of any older ones, so the apply side diffs the first captured DDL
   after C against the shape the copy was made at.

The stream of the slot starts with the first transaction committed at or after
C, and the engine applies transactions from C on, so copy and stream meet
exactly: nothing missed, nothing applied twice.

Interruptions (resume or restart):

- Within a run, a table whose copy fails is retried once. Partitions
  written before the failure are recorded in ``applier_sync_parts`` in the same
  transaction as their rows, so the retry *resumes*: it writes only the missing
  partitions (same snapshot, still open). The message says so.
- A sync that fails (after the retry, or for any other reason) drops the slot
  it created and says so: without a completed copy the slot is useless (its
  snapshot is gone) and would only hold WAL. The slot is active until the
  closed connection's walsender has exited: the drop waits up to ``DROP_WAIT``
  seconds for that. If dropping fails, it says that the slot is kept, that it
  holds WAL, and the statement that drops it.
- Across runs an exported snapshot cannot be recovered, so a sync row left at
  ``copying`` means the next ``sync`` *restarts*: it says "restarting the
  interrupted sync", empties the published target tables, drops the slot and
  creates it again with a new snapshot, and copies everything.
- A slot that exists when no copy has completed (made by ``applier init``, or
  left by a killed run) is dropped and created again, with a message.
- A table created without its keys has a row in ``applier_keys_owed`` until
  they are built (``applier.targets.postgres.schema``): a rerun copies it again,
  then builds them. A table that existed before sync keeps its indexes.
- A completed sync is not repeated unless ``force``; a fresh sync refuses
  target tables that already hold rows unless ``force`` (which empties them).

While a sync runs, do not run ``applier run`` / ``catchup`` for the same
target (they would start streaming before the copy is complete).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql as psql

from applier.admin import check_source, check_target, source_connect, upgrade_control_tables
from applier.config import Config, ConfigError
from applier.ddl.shape import TableShape
from applier.lsn import LSN
from applier.migrate.schema import (
    Prepared,
    SourceTable,
    prepare_tables,
    read_source_tables,
    target_table_name,
)
from applier.migrate.spark.copy import CopyWatcher, binary_safe, copy_partitions, partitions_for, running_copies
from applier.migrate.spark.pgcopy import CopyError, CopyPlan, parts_sql
from applier.migrate.spark.plans import pg_plan
from applier.migrate.spark.progress import Reporter
from applier.migrate.spark.session import begin, copy_streams, is_local, local_copy_streams, spark_context, spark_of
from applier.progress.store import shape_row
from applier.rows import one_row
from applier.source import capture
from applier.source.base import SourceError
from applier.source.walsender import WalSender
from applier.targets import opener
from applier.targets.backend import Backend
from applier.targets.backends import backend_of
from applier.targets.claim import Held, copy_claim_name
from applier.text import one_line, quote_ident


class SyncError(ConfigError):
    """Sync cannot go on; the message says why and what to do."""


@dataclass
class TableCopy:
    """One table's copy."""

    table: str
    target: str
    rows: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    partitions: int = 0
    copy_format: str | None = None  # PostgreSQL target: the COPY format, 'binary' or 'text'


@dataclass
class SyncResult:
    """What ``sync`` did."""

    mode: str  # 'fresh', 'restart' or 'force'; 'table': `sync --table` (applier.migrate.add_table)
    slot: str
    consistent_point: LSN
    tables: list[TableCopy] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    copy_seconds: float = 0.0

    @property
    def rows(self) -> int:
        """Rows copied in all."""
        return sum(t.rows for t in self.tables)

    @property
    def nbytes(self) -> int:
        """Bytes of values copied in all."""
        return sum(t.nbytes for t in self.tables)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class TargetDb:
    """The few things sync and verify do on the target, for PostgreSQL and SQLite."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.backend = backend_of(cfg)
        self.table_map = cfg.target["tables"]
        self._claim: Held | None = None
        self.where = self.backend.claim_key(opener.location(cfg))
        self.conn: Any = opener.open(cfg, plain=True, autocommit=True)
        self.backend.prepare_copy(self.conn)
        self.ph = self.backend.placeholder

    def claim(self, command: str) -> None:
        """Hold ``apply.name``'s progress row until ``close`` (see applier.targets.claim); InUseError if taken."""
        self._claim = self.backend.claim(self.conn, self.where, self.cfg.apply["name"], command)

    def holder(self, key: str) -> str | None:
        """Who holds the claim ``key`` on this target now (None: nobody); takes nothing."""
        return self.backend.holder(self.conn, self.where, key)

    def close(self) -> None:
        """Close the connection (and give up the claim)."""
        self.conn.close()
        if self._claim is not None:
            self._claim.release()

    def execute(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (autocommit); its rows."""
        cur = self.backend.execute(self.conn, sql, params)
        return cur.fetchall() if cur.description is not None else []

    def transaction(self, statements: list[tuple[str, list[Any]]], durable: bool = False) -> list[int]:
        """Run statements in one transaction; ``durable``: flushed to disk when it returns. The rows each statement
        changed."""
        return self.backend.transaction(self.conn, statements, durable)

    # -- tables ---------------------------------------------------------------------

    def name_of(self, table: SourceTable) -> tuple[str, str]:
        """(name for people, quoted name) of a source table's target table."""
        return target_table_name(table, self.backend, self.table_map)

    def prepare(self, tables: list[SourceTable]) -> Prepared:
        """Check existing target tables, create missing ones (SchemaError on a mismatch); on PostgreSQL with the
        user types and sequences they need, read from the source."""
        return prepare_tables(self.backend, self.conn, tables, self.table_map, lambda: source_connect(self.cfg))

    def build_keys(self, table: SourceTable) -> bool:
        """Build the keys table creation left for after the copy of the table, if it owes them
        (``Backend.build_keys``); whether it did."""
        return self.backend.build_keys(self.conn, table, *self.backend.target_table(table.relation(), self.table_map))

    def exists(self, table: SourceTable) -> bool:
        """Whether the target table exists."""
        return self.backend.exists(self.conn, *self.name_of(table))

    def has_rows(self, table: SourceTable) -> bool:
        """Whether the target table holds any row of its own (not its inheritance children's: ``own``)."""
        return bool(self.execute(f"SELECT 1 FROM {self.own(table)} LIMIT 1"))

    def own(self, table: SourceTable) -> str:
        """The target table as a query names its own rows: ``ONLY`` it on PostgreSQL unless partitioned (a
        partitioned table's rows are its partitions'; an inheritance child's are not its parent's)."""
        name = self.name_of(table)[1]
        return name if not self.backend.has_inheritance or self.partitioned(table) else f"ONLY {name}"

    def empty_tables(self, tables: list[SourceTable], command: str = "applier sync") -> None:
        """Delete every row of these target tables (TRUNCATE ONLY on PostgreSQL: not their inheritance children's,
        a partitioned table's partitions'), in one transaction (``command``: the one to run again, named in a
        refusal).

        PostgreSQL truncates only tables that no other table references: tables outside ``tables`` that refer
        to them (also through others) are truncated with them when they are empty (a partitioned one when its
        leaves other than those emptied here are), else SyncError naming the reference (their rows would lose
        what they refer to; nothing is emptied).
        """
        names = [self.name_of(t)[1] for t in tables]
        if not self.backend.has_inheritance:  # nor foreign keys enforced on this connection (SQLite)
            self.transaction([(f"DELETE FROM {n}", []) for n in names])
            return
        with self.conn.transaction():
            oids = [r[0] for n in names for r in self.execute("SELECT to_regclass(%s)::oid", [n])]
            outside: list[int] = []
            while True:
                refs = self.execute(
                    "SELECT conrelid::int, conrelid::regclass::text, conname, confrelid::regclass::text "
                    "FROM pg_constraint WHERE contype = 'f' AND confrelid = ANY(%s) AND NOT conrelid = ANY(%s) "
                    "ORDER BY 2, 3", [oids + outside, oids + outside])
                if not refs:
                    break
                for oid, referencing, constraint, referenced in refs:
                    if oid in outside:
                        continue
                    self.execute(f"LOCK TABLE {referencing} IN SHARE MODE")
                    holder = self._rows_kept(oid, referencing, oids + outside)
                    if holder is not None:
                        where = "" if holder == referencing else f" (in its partition {holder})"
                        raise SyncError(f"cannot empty target table {referenced} for the copy: target table "
                                        f"{referencing}, which is not published, references it (foreign key "
                                        f"{constraint}) and holds rows{where}; empty {referencing} or drop "
                                        f"{constraint}, then run `{command}` again")
                    outside.append(oid)
            # ONLY each table but a partitioned one (whose rows are its partitions'): never an inheritance child,
            # which keeps its own rows (published, it is in ``tables``)
            parted = {r[0] for r in self.execute("SELECT oid FROM pg_class WHERE oid = ANY(%s) AND relkind = 'p'",
                                                 [oids])}
            own = [n if oid in parted else f"ONLY {n}" for oid, n in zip(oids, names, strict=True)]
            others = [r[0] for r in self.execute(
                "SELECT CASE relkind WHEN 'p' THEN '' ELSE 'ONLY ' END || oid::regclass::text FROM pg_class "
                "WHERE oid = ANY(%s)", [outside])]
            self.execute("TRUNCATE " + ", ".join(own + others))

    def _rows_kept(self, oid: int, name: str, emptied: list[int]) -> str | None:
        """The table (``name`` or a partition of it) whose rows would stay once the tables ``emptied`` (oids) are:
        a partitioned table's rows are its leaves', those emptied left out; any other table's are its own (TRUNCATE
        ONLY leaves its inheritance children alone). None: no row would stay."""
        if not self.execute("SELECT 1 FROM pg_class WHERE oid = %s AND relkind = 'p'", [oid]):
            return name if self.execute(f"SELECT 1 FROM ONLY {name} LIMIT 1") else None
        for (leaf,) in self.execute("SELECT relid::regclass::text FROM pg_partition_tree(%s::oid) "
                                    "WHERE isleaf AND NOT relid::oid = ANY(%s::oid[]) ORDER BY 1", [oid, emptied]):
            if self.execute(f"SELECT 1 FROM {leaf} LIMIT 1"):
                return str(leaf)
        return None

    def partitioned(self, table: SourceTable) -> bool:
        """Whether the PostgreSQL target table is partitioned (its rows are its partitions')."""
        return bool(self.execute("SELECT 1 FROM pg_class WHERE oid = to_regclass(%s) AND relkind = 'p'",
                                 [self.name_of(table)[1]]))

    def column_names(self, table: SourceTable) -> set[str]:
        """Every column the target table holds, generated ones included."""
        return set(self.backend.column_names(self.conn, *self.name_of(table)))

    def columns_without_default(self, table: SourceTable) -> list[str]:
        """Columns of the target table that have no default (nor identity or generation expression)."""
        return self.backend.column_names(self.conn, *self.name_of(table), defaulted=False)

    def count(self, table: SourceTable) -> int:
        """Rows of the target table (its own: ``own``)."""
        return int(self.execute(f"SELECT count(*) FROM {self.own(table)}")[0][0])

    # -- sync state -------------------------------------------------------------------

    def sync_state(self, name: str) -> dict[str, Any] | None:
        """The sync row of ``name``, or None."""
        ph = self.ph
        rows = self.execute(f"SELECT state, run, slot, consistent_point, started_at, finished_at FROM applier_sync "
                            f"WHERE name = {ph}", [name])
        if not rows:
            return None
        return dict(zip(("state", "run", "slot", "consistent_point", "started_at", "finished_at"), rows[0]))

    def start_run(self, name: str, run: str, slot: str) -> None:
        """Sync row to 'copying' with a new run id; forget the partitions of earlier runs, the tables joined
        by ``sync --table`` and the changes held for them (this copy copies every published table)."""
        ph = self.ph
        self.transaction([
            (f"DELETE FROM applier_sync_parts WHERE name = {ph}", [name]),
            (f"DELETE FROM applier_sync_tables WHERE name = {ph}", [name]),
            (f"DELETE FROM applier_held WHERE name = {ph}", [name]),
            (f"DELETE FROM applier_sync WHERE name = {ph}", [name]),
            (f"INSERT INTO applier_sync (name, state, run, slot, started_at) VALUES ({ph}, 'copying', {ph}, {ph}, {ph})",
             [name, run, slot, _now()]),
        ], durable=True)

    def set_consistent_point(self, name: str, lsn: LSN) -> None:
        """Remember the slot's consistent point in the sync row."""
        self.transaction([(f"UPDATE applier_sync SET consistent_point = {self.ph} WHERE name = {self.ph}",
                           [str(lsn), name])])

    def parts(self, name: str, run: str, tbl: str) -> dict[int, tuple[int, int]]:
        """Finished partitions of a table in this run: part -> (rows, bytes)."""
        return {int(p): (int(r), int(b)) for p, r, b in self.execute(parts_sql(self.ph)[2], [name, run, tbl])}

    def finish(self, name: str, lsn: LSN, source_system: str | None, slot: str,
               shapes: Sequence[TableShape] = (), timeline: int | None = None) -> None:
        """Progress row to ``lsn`` of ``source_system`` (on ``timeline``) and ``slot``, pending skip cleared, sync row 'done', the followed
        shapes replaced by ``shapes`` (the copied tables' at ``lsn``): one durable transaction."""
        sql = self.backend.sql
        ph = self.ph
        self.transaction([
            (f"DELETE FROM applier_ddl_tables WHERE name = {ph}", [name]),
            *[(sql.keep_shape, shape_row(name, s, lsn)) for s in shapes],
            (sql.upsert, [name, str(lsn), None, source_system, slot, timeline]),
            (sql.clear_skip, [name]),
            (f"UPDATE applier_sync SET state = 'done', finished_at = {ph} WHERE name = {ph}", [_now(), name]),
            (f"DELETE FROM applier_sync_parts WHERE name = {ph}", [name]),
        ], durable=True)


def slot_row(cfg: Config) -> tuple[bool, int | None] | None:
    """(active, active pid) of the configured slot, or None if it does not exist."""
    with source_connect(cfg) as conn:
        row = conn.execute("SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = %s",
                           [cfg.source["slot"]]).fetchone()
    return None if row is None else (bool(row[0]), row[1])


DROP_WAIT = 10.0  # seconds a slot may stay active after its replication connection closed (its walsender exiting)


def _drop_slot(cfg: Config) -> None:
    """Drop the configured slot.

    A walsender exits asynchronously after its connection closes: until it has, dropping fails with SQLSTATE 55006
    ("replication slot … is active for PID …"). That is tried again (short sleeps) for up to ``DROP_WAIT`` seconds;
    then, or on any other error, the error is raised.
    """
    deadline = time.monotonic() + DROP_WAIT
    with source_connect(cfg) as conn:
        while True:
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", [cfg.source["slot"]])
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)


def _signature(tables: list[SourceTable]) -> list[tuple[Any, ...]]:
    return [(t.qualified, tuple((c.name, c.type_sql) for c in t.columns), t.rowfilter) for t in tables]


@contextlib.contextmanager
def _in_snapshot(cfg: Config, snapshot: str | None) -> Iterator[psycopg.Connection[Any]]:
    """A source connection that sees the exported snapshot (sees now, without a snapshot)."""
    with source_connect(cfg) as conn:
        if snapshot is None:
            yield conn
            return
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(psql.SQL("SET TRANSACTION SNAPSHOT {}").format(psql.Literal(snapshot)))
        try:
            yield conn
        finally:
            conn.execute("ROLLBACK")


def read_tables_in_snapshot(cfg: Config, snapshot: str | None) -> list[SourceTable]:
    """The published tables as the exported snapshot sees them (now, without a snapshot)."""
    with _in_snapshot(cfg, snapshot) as conn:
        return read_source_tables(conn, cfg.source["publications"])


def shapes_in_snapshot(cfg: Config, snapshot: str | None, tables: list[SourceTable], say: Any) -> list[TableShape]:
    """The shapes of ``tables`` in the snapshot when DDL capture is installed in it (``capture.shapes``), else none;
    when they cannot be read, a line said and none (the apply side then learns them from the stream)."""
    try:
        with _in_snapshot(cfg, snapshot) as conn:
            return capture.shapes(conn, [t.oid for t in tables]) or []
    except psycopg.Error as exc:
        say(f"DDL capture: the tables' shapes at the snapshot could not be read ({one_line(exc)}); they are "
            f"learnt from the stream")
        return []


def count_in_snapshot(cfg: Config, snapshot: str | None, table: SourceTable) -> int:
    """The published rows of a source table (its own, or a partitioned root's, row filter applied) in the snapshot."""
    sql = f"SELECT count(*) FROM {'ONLY ' if table.only else ''}{table.qname}"
    if table.rowfilter:
        sql += f" WHERE ({table.rowfilter})"
    with _in_snapshot(cfg, snapshot) as conn:
        return int(one_row(conn.execute(sql))[0])


def sync(cfg: Config, *, force: bool = False, spark: Any = None, reporter: Any = None,
         say: Any = None, partitions: int | None = None) -> SyncResult:
    """Create the slot with a snapshot, create the target tables, copy them, record the slot's consistent point.

    ``say(line)`` gets the messages for people (mode, slot, restarts, retries);
    ``reporter`` the per-table progress (``applier.migrate.spark.progress``); ``spark`` a SparkSession or
    SparkContext, or a ``SparkStart`` (begun once the checks pass, on a local master once the published tables are
    read; waited for when the copy begins), else a SparkContext is started then; only when a table's copy is a
    Spark job (``by_spark``: a PostgreSQL target's table, but on a local master neither a small one nor any where
    the master copies one stream at a time).
    """
    say = say or (lambda line: None)
    reporter = reporter or Reporter()
    try:
        return _sync(cfg, force, spark, reporter, say, partitions)
    finally:
        reporter.close()


def _sync(cfg: Config, force: bool, spark: Any, reporter: Any, say: Any, partitions: int | None) -> SyncResult:
    nparts = partitions or cfg.spark["partitions"]
    name, slot = cfg.apply["name"], cfg.source["slot"]
    check_source(cfg, need_slot=False)
    revision = check_target(cfg, need_init=False)
    master = cfg.spark["master"]
    local = is_local(master)
    if not local:
        begin(spark)  # a background start of Spark: the checks passed (on a cluster every table's copy is a job)
    if line := upgrade_control_tables(cfg, revision):
        say(line)
    target = TargetDb(cfg)
    try:
        target.claim("sync")  # no applier may write the progress row while the copy makes it
        tables = read_tables_in_snapshot(cfg, None)
        if not tables:
            raise SyncError(f"{cfg.where('source', 'publications')}: the publications "
                            f"{', '.join(cfg.source['publications'])} publish no tables")
        if local and any(by_spark(target.backend, master, t.size_pages) for t in tables):
            begin(spark)  # as above: on a local master, once some table is more than the driver copies itself
        state = target.sync_state(name)
        if state and state["state"] == "done" and not force:
            raise SyncError(f"a sync for {name!r} already completed at {state['consistent_point']} "
                            f"({state['finished_at']}); `applier run` / `catchup` continue from there. "
                            f"Use --force to copy everything again (empties the target tables)")
        if state and state["state"] != "done":
            mode = "restart"
            say(f"restarting the interrupted sync (started {state['started_at']}): the published target tables "
                f"are emptied, the slot {slot!r} is created again with a new snapshot, every table is copied again")
        elif force:
            mode = "force"
            say("copying everything again (--force): the published target tables are emptied first")
        else:
            mode = "fresh"
            full = [target.name_of(t)[0] for t in tables if target.exists(t) and target.has_rows(t)]
            if full:
                raise SyncError("target tables already hold rows: " + ", ".join(full)
                                + "; sync copies into empty tables (use --force to empty them first)")
        slot_state = slot_row(cfg)
        if slot_state is not None and slot_state[0]:
            raise SyncError(f"{cfg.where('source', 'slot')}: slot {slot!r} is in use (pid {slot_state[1]}); "
                            f"stop `applier run` first")
        # after the refusals above: a refused sync creates no table (one left keyless, its keys owed to a copy
        # that never comes, would be taken by a running daemon for a table made by hand)
        prepared = target.prepare(tables)
        for t in prepared.created:
            say(f"created target table {t}")
        run = uuid.uuid4().hex
        target.start_run(name, run, slot)
        # after start_run: a `sync --table` that claims a table later reads the sync row 'copying' and stops
        copying = [f"{t.qualified} ({h})" for t in tables
                   if (h := target.holder(copy_claim_name(name, t.schema, t.name))) is not None]
        if copying:
            raise SyncError("`applier sync --table` is copying " + "; ".join(copying) + ": let it end (or stop it), "
                            "then run `applier sync` again")
        if slot_state is not None:
            say(f"slot {slot!r} exists but no copy has completed with it: dropping it and creating it again "
                f"with a snapshot")
            _drop_slot(cfg)
        result = _copy_with_new_slot(cfg, target, tables, run, mode, nparts, spark, reporter, say)
        result.created = prepared.created
        return result
    finally:
        target.close()


def _copy_with_new_slot(cfg: Config, target: TargetDb, tables: list[SourceTable], run: str, mode: str, nparts: int,
                        spark: Any, reporter: Any, say: Any) -> SyncResult:
    name, slot = cfg.apply["name"], cfg.source["slot"]
    try:
        ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
    except SourceError as exc:
        raise ConfigError(f"{cfg.where('source', 'dsn')}: {exc}") from None
    incomplete = False  # this run's slot exists and no copy has completed with it
    try:
        try:
            ident = ws.identify_system()
            system = ident["systemid"]
            info = ws.create_slot(slot, two_phase=cfg.source["two_phase"], snapshot="export",
                                  failover=cfg.source["failover"])
        except SourceError as exc:
            raise SyncError(f"{cfg.where('source', 'slot')}: {exc}") from None
        incomplete = True
        say(f"slot {slot!r} created; consistent point {info.consistent_point}, snapshot {info.snapshot_name}")
        target.set_consistent_point(name, info.consistent_point)
        in_snapshot = read_tables_in_snapshot(cfg, info.snapshot_name)
        if _signature(in_snapshot) != _signature(tables):
            raise SyncError("the published tables changed while sync started; run `applier sync` again")
        if mode != "fresh":
            target.empty_tables(in_snapshot)
        result = SyncResult(mode, slot, info.consistent_point)
        failed = copy_tables(cfg, target, in_snapshot, run, info.snapshot_name, nparts, spark, reporter, say, result)
        if failed:
            raise SyncError(f"{len(failed)} of {len(in_snapshot)} tables could not be copied (the others were); "
                            f"fix the cause and run `applier sync` again (it copies everything again):\n  "
                            + "\n  ".join(failed))
        reporter.close()
        target.finish(name, info.consistent_point, system, slot,
                      shapes_in_snapshot(cfg, info.snapshot_name, in_snapshot, say), int(ident["timeline"] or 0) or None)
        incomplete = False
        say(f"sync complete: {result.rows:,} rows in {len(result.tables)} tables; the target is at "
            f"{info.consistent_point}, `applier run` / `catchup` continue from there")
        return result
    except BaseException:
        if incomplete:
            ws.close()  # ends the exported snapshot; the slot is free to drop
            _drop_incomplete_slot(cfg, say)
        raise
    finally:
        ws.close()


def _drop_incomplete_slot(cfg: Config, say: Any) -> None:
    """Drop the slot of a failed copy (useless: its snapshot is gone; it would only hold WAL), or say it is kept."""
    slot = cfg.source["slot"]
    try:
        _drop_slot(cfg)
    except (ConfigError, psycopg.Error) as exc:
        say(f"slot {slot!r} is kept ({one_line(exc)}); it holds WAL on the source until dropped: "
            f"SELECT pg_drop_replication_slot('{slot}')")
        return
    say(f"slot {slot!r} dropped: the copy did not complete; `applier sync` creates it again")


def copy_tables(cfg: Config, target: TargetDb, tables: list[SourceTable], run: str, snapshot: str | None, nparts: int,
                spark: Any, reporter: Any, say: Any, result: SyncResult, after: Any = None) -> list[str]:
    """Copy each table in the snapshot (``_copy_table``; ``after(table)`` once one is copied) into ``result``
    (its ``tables`` and ``copy_seconds``, from the first table's copy on); the failures, one line each. A table
    that cannot be copied does not stop the others. ``result.mode`` 'table': the run is that of each table's
    applier_sync_tables row, else that of the sync row (``applier.migrate.spark.pgcopy.check_run``)."""
    master = cfg.spark["master"]
    # a SQLite target's tables, and a PostgreSQL target's small ones on a local master, the driver copies itself
    if any(by_spark(target.backend, master, t.size_pages) for t in tables):
        spark = spark_of(spark) if spark is not None else spark_context(master)
    else:
        spark = None
    started = time.monotonic()
    failed: list[str] = []
    # key builds at once: as many as copy streams, at most KEY_JOBS (each holds a connection and the target's
    # maintenance_work_mem; pgcopydb's --index-jobs defaults to 4 too)
    streams = (copy_streams(spark) if spark is not None
               else local_copy_streams(master) if is_local(master) else 1)
    keys = KeyBuilder(cfg, min(KEY_JOBS, streams)) if target.backend.keys_after_copy else None

    def copied(table: SourceTable, error: str | None, built: str | None = None) -> None:
        if error is not None:
            failed.append(error)
            say(f"{error}; going on with the other tables")
            return
        if built is not None:
            say(built)
        if after is not None:
            after(table)

    try:
        with source_connect(cfg) as poll:
            for i, table in enumerate(tables):
                try:
                    result.tables.append(_copy_table(cfg, target, table, i, run, snapshot, nparts, spark, reporter,
                                                     say, poll, result.mode == "table"))
                except CopyError as exc:
                    copied(table, str(exc))
                    continue
                if keys is None:
                    copied(table, None)
                    continue
                keys.submit(table, _label(target, table))
                # a table joining a running stream (`sync --table`) is ready once its keys exist, not after the
                # next tables' copies: its changes are held until then
                for done in keys.ended(wait=result.mode == "table"):
                    copied(*done)
        for done in keys.ended(wait=True) if keys is not None else ():
            copied(*done)
    finally:
        if keys is not None:
            keys.close()
    result.copy_seconds = time.monotonic() - started
    return failed


KEY_JOBS = 4  # tables whose keys are built at once, at most (``KeyBuilder``)
KEYS_IDLE_S = 10.0  # seconds a key-building worker keeps its target connection while no build waits (``KeyBuilder``)
# pages (8 kB, weighed as ``applier.migrate.spark.copy.GROUP_PAGES``) of a PostgreSQL target's table that a sync on a
# local master copies in the driver (``by_spark``): 8 MiB, about a quarter of a second of copying, a few Spark jobs'
# fixed cost
DRIVER_PAGES = 1024


def by_spark(target: Backend, master: str, size_pages: int) -> bool:
    """Whether the copy of a table of ``size_pages`` pages (``SourceTable.size_pages``: every leaf, TOAST) into
    ``target`` is a Spark job on ``master`` (``spark.master``): a PostgreSQL target's, unless the master is local and
    either the table is at most ``DRIVER_PAGES`` or the master copies one stream at a time (``local_copy_streams``:
    ``local[2]``, ``local[*]`` on 2-3 CPUs), where Spark would run the same one task on this machine after its JVM
    and a Python worker had started. The driver then copies it as that task would (``applier.migrate.spark.copy``)."""
    return target.copies_by_spark and not (
        is_local(master) and (size_pages <= DRIVER_PAGES or local_copy_streams(master) == 1))


class KeyBuilder:
    """Builds the keys that table creation left for after the copy (``Backend.keys_after_copy``, as pg_dump and
    pgcopydb build indexes after the data): each table's as soon as its copy is over, while the next tables copy,
    up to ``jobs`` tables at once, each worker on a target connection of its own (``TargetDb.build_keys``).

    Its workers are daemon threads: a command that stops (Ctrl-C, an error) exits without waiting for a build
    (``close`` cancels those under way; one that cannot be reached is ended by the server when its connection
    goes, or commits its keys and the deletion of its ``applier_keys_owed`` row together, which a rerun's copy
    finds consistent)."""

    def __init__(self, cfg: Config, jobs: int) -> None:
        self.cfg = cfg
        self.jobs = max(1, jobs)
        self.running: list[tuple[SourceTable, Future[tuple[str | None, str | None]]]] = []
        self._queue: queue.SimpleQueue[tuple[Future[tuple[str | None, str | None]], SourceTable, str] | None] = (
            queue.SimpleQueue())
        self._workers: list[threading.Thread] = []
        self._building: set[TargetDb] = set()  # the connections of the builds under way (``close`` cancels them)
        self._closed = False  # ``close`` was called: a build not yet under way does not start
        self._lock = threading.Lock()

    def submit(self, table: SourceTable, label: str) -> None:
        """Build the table's keys (if it owes them) in the background."""
        future: Future[tuple[str | None, str | None]] = Future()
        self.running.append((table, future))
        self._queue.put((future, table, label))
        if len(self._workers) < min(self.jobs, len(self.running)):
            worker = threading.Thread(target=self._work, name=f"applier-sync-keys-{len(self._workers)}", daemon=True)
            self._workers.append(worker)
            worker.start()

    def _work(self) -> None:
        """A worker's builds, one after another on one target connection (made at its first build, made anew after a
        build that failed on it; closed when the next build is ``KEYS_IDLE_S`` away: a large table's copy may take
        hours, no session is left idle that long)."""
        held: list[TargetDb] = []
        try:
            while (job := self._next(held)) is not None:
                future, table, label = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(self._build(held, table, label))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter (``ended``)
                    future.set_exception(exc)
        finally:
            for target in held:
                target.close()

    def _next(self, held: list[TargetDb]) -> tuple[Future[tuple[str | None, str | None]], SourceTable, str] | None:
        """The next job (None: stop); the held connection closed once none came for ``KEYS_IDLE_S``."""
        try:
            return self._queue.get(timeout=KEYS_IDLE_S)
        except queue.Empty:
            while held:
                held.pop().close()
            return self._queue.get()

    def _build(self, held: list[TargetDb], table: SourceTable, label: str) -> tuple[str | None, str | None]:
        """The table's keys built (or none owed) on the worker's connection ``held`` (empty: none yet): (the
        failure's line, the line saying they were built)."""
        started = time.monotonic()
        try:
            if not held:
                held.append(TargetDb(self.cfg))
            target = held[0]
            with self._lock:
                if self._closed:  # closed while this build connected: cancelled before it starts
                    return None, None
                self._building.add(target)
            try:
                built = target.build_keys(table)
            except BaseException:
                held.pop().close()  # in whatever state the failure left it
                raise
            finally:
                with self._lock:
                    self._building.discard(target)
        except ConfigError as exc:  # SchemaError: names the table and the statement
            return str(exc), None
        except psycopg.Error as exc:
            return f"building the keys of {label} after its copy failed: {one_line(exc)}", None
        return None, f"{label}: keys built after the copy ({time.monotonic() - started:.1f} s)" if built else None

    def ended(self, wait: bool) -> list[tuple[SourceTable, str | None, str | None]]:
        """The tables whose build is over (``wait``: every one, waited for), each once, in the order submitted:
        (table, the failure's line, the line saying the keys were built)."""
        out = []
        while self.running and (wait or self.running[0][1].done()):
            table, future = self.running.pop(0)
            out.append((table, *future.result()))
        return out

    def close(self) -> None:
        """Stop: builds not started are not, and those under way are cancelled (their transaction is rolled back:
        the table still owes its keys, and a rerun copies it again), so a stop never waits for a build, nor for a
        lock a build waits for. After the builds were waited for (``ended(True)``), nothing is under way."""
        for _, future in self.running:
            future.cancel()
        for _ in self._workers:
            self._queue.put(None)
        with self._lock:
            self._closed = True
            building = list(self._building)
        for target in building:
            with contextlib.suppress(Exception):  # ended meanwhile, or the server gone: nothing to cancel
                target.conn.cancel_safe(timeout=5)


def _label(target: TargetDb, table: SourceTable) -> str:
    """A table as the copy's lines name it: the source table, and its target table if named otherwise."""
    shown = target.name_of(table)[0]
    return table.qualified if shown in (table.qualified, table.name) else f"{table.qualified} -> {shown}"


def _copy_table(cfg: Config, target: TargetDb, table: SourceTable, index: int, run: str, snapshot: str | None,
                nparts: int, spark: Any, reporter: Any, say: Any, poll: psycopg.Connection[Any],
                joining: bool) -> TableCopy:
    name = cfg.apply["name"]
    shown, qtarget = target.name_of(table)
    label = _label(target, table)
    cols = [quote_ident(c.name) for c in table.columns]
    app = f"applier-sync {run[:8]} t{index}"
    src = pg_plan(cfg.source["dsn"], table.qname, cols, pages=table.pages,
                  partitions=partitions_for(target.backend, table.pages, nparts), snapshot=snapshot,
                  where=table.rowfilter, app=app, only=table.only)
    plan = CopyPlan(json.loads(src), target.backend.kind, target.where, qtarget, cols, [c.type_oid for c in table.columns],
                    name, run, table.qualified, joining=(table.schema, table.name) if joining else None,
                    weight=max(1.0, table.size_pages / max(1, table.pages)))
    if target.backend.copies_by_spark and table.columns:
        plan.binary = binary_safe(target.conn, qtarget, [(c.name, c.type_oid) for c in table.columns])
    nranges = plan.partitions
    reporter.start(label, table.estimated_rows)
    started = time.monotonic()
    if not table.columns:
        _copy_rowless(cfg, target, table, run, snapshot, label)
    for attempt in (1, 2) if table.columns else ():
        watcher = CopyWatcher(lambda: target.parts(name, run, table.qualified), lambda: running_copies(poll, app),
                              lambda rows, nbytes: reporter.update(label, rows, nbytes))
        try:
            with watcher:
                copy_partitions(spark if by_spark(target.backend, cfg.spark["master"], table.size_pages) else None,
                                plan, target.parts(name, run, table.qualified), label)
            break
        except CopyError as exc:
            if attempt == 2:
                raise
            done = len(target.parts(name, run, table.qualified))
            say(f"{exc}; retrying the table once, resuming: {done} of {nranges} partitions are already copied")
    parts = target.parts(name, run, table.qualified)
    rows = sum(r for r, _ in parts.values())
    nbytes = sum(b for _, b in parts.values())
    seconds = time.monotonic() - started
    reporter.finish(label, rows, nbytes, seconds)
    fmt = None if not target.backend.copies_by_spark or not table.columns else "binary" if plan.binary else "text"
    return TableCopy(table.qualified, shown, rows, nbytes, seconds, nranges, fmt)


def _copy_rowless(cfg: Config, target: TargetDb, table: SourceTable, run: str, snapshot: str | None,
                  label: str) -> None:
    """Copy a table that publishes no columns (a PostgreSQL target; SQLite refuses it): as many rows as the
    source has in the snapshot, recorded as its partition 0 in the same transaction (written once)."""
    name = cfg.apply["name"]
    if target.parts(name, run, table.qualified):
        return
    rows = count_in_snapshot(cfg, snapshot, table)
    try:
        target.transaction([(f"INSERT INTO {target.name_of(table)[1]} SELECT FROM generate_series(1, {rows})", []),
                            (parts_sql(target.ph)[1], [name, run, table.qualified, 0, rows, 0])])
    except psycopg.Error as exc:
        raise CopyError(f"copying {label} failed: {type(exc).__name__}: {one_line(exc)}") from None
