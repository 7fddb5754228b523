"""A table added to a running replica: the library function behind ``applier sync --table``.

``sync_tables(cfg, ["schema.table", ...])`` copies tables that were added to the
publications (or whose publication was added to ``source.publications``) after
the full ``applier sync``, and joins them to the stream without a gap or a
double, while ``applier run`` keeps running or not:

1. per table, in this order: its ``applier_sync_tables`` row set to 'init' (a
   durable transaction), then the target table created (``TargetDb.prepare``, as
   the full sync does) or, if it exists, emptied. The row comes first, so that
   whoever sees the table (the engine binds a table, then reads its row) sees
   the row too: from then on the engine never applies a change to the table
   without placing it against the copy's snapshot;
2. a temporary logical slot on a replication connection with ``SNAPSHOT
   'export'``: its consistent point S and a snapshot that sees exactly the
   source transactions committed before S. The rows get state 'copying' and S
   (durable);
3. each table copied in that snapshot by the full sync's copy
   (``applier.migrate.sync._copy_table``: partitions recorded in
   ``applier_sync_parts`` with their rows);
4. each copied table's row set to 'ready' (durable: the copy's commits are
   flushed with it). The temporary slot ends with its connection.

The engine (``applier.engine.apply``) skips a joining table's changes of source
transactions committed before S (they are in the copy) and applies the later
ones once the table is 'ready'; until then they wait, and ``applier run`` holds
at S (its lag grows) while the copy runs.

Refused, one line each: a target without a completed full sync, a two-phase
config (a prepared transaction is applied before its commit LSN is known, so
it cannot be placed against S; PostgreSQL's ``ALTER SUBSCRIPTION … REFRESH
PUBLICATION`` refuses ``copy_data`` with ``two_phase`` too), a table that is
not published by the configured publications. A table whose row is 'init' or
'copying' (an interrupted run) is emptied and copied again. A target table
that exists without a row, or one already 'ready', is refused unless ``force``;
with ``force`` only while no applier holds the progress row (``applier run``
may have applied changes to that table already: it must be stopped).
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from typing import Any

import psycopg

from applier.admin import check_source, check_target, source_connect
from applier.config import Config
from applier.migrate.schema import SourceTable
from applier.migrate.spark.progress import Reporter
from applier.migrate.spark.session import spark_for
from applier.migrate.sync import (
    SyncError,
    SyncResult,
    TargetDb,
    _copy_table,
    _now,
    _signature,
    read_tables_in_snapshot,
)
from applier.progress.migrate import migrate
from applier.source.base import SourceError
from applier.source.walsender import WalSender
from applier.targets.claim import target_holder
from applier.text import one_line


def sync_tables(cfg: Config, names: list[str], *, force: bool = False, spark: Any = None, reporter: Any = None,
                say: Any = None, partitions: int | None = None) -> SyncResult:
    """Copy the source tables ``names`` ("schema.table"; a bare name is in ``public``) and join them to the stream
    (see the module header); the result's ``consistent_point`` is the copy's snapshot point S."""
    say = say or (lambda line: None)
    reporter = reporter or Reporter()
    try:
        return _sync_tables(cfg, names, force, spark, reporter, say, partitions)
    finally:
        reporter.close()


def split_name(name: str) -> tuple[str, str]:
    """(schema, table) of "schema.table" ("public" for a bare name)."""
    schema, dot, table = name.partition(".")
    return (schema, table) if dot else ("public", name)


def _sync_tables(cfg: Config, names: list[str], force: bool, spark: Any, reporter: Any, say: Any,
                 partitions: int | None) -> SyncResult:
    name = cfg.apply["name"]
    if cfg.source["two_phase"]:
        raise SyncError(f"{cfg.where('source', 'two_phase')}: `applier sync --table` cannot join a table to a "
                        f"two-phase stream: a prepared transaction is applied before its commit LSN is known, so it "
                        f"cannot be placed before or after the copy's snapshot (PostgreSQL's ALTER SUBSCRIPTION … "
                        f"REFRESH PUBLICATION refuses copy_data with two_phase too)")
    check_source(cfg)
    check_target(cfg, need_init=False)
    before, after = migrate(cfg.target["url"])
    if before != after:
        say(f"control tables: {'created at' if before is None else 'upgraded from ' + before + ' to'} {after}")
    target = TargetDb(cfg)
    try:
        state = target.sync_state(name)
        if state is None or state["state"] != "done":
            raise SyncError(f"`applier sync --table` adds tables to a replica that `applier sync` made, but for "
                            f"apply.name {name!r} " + ("no sync has run" if state is None else
                                                       f"the sync is {state['state']} (interrupted)")
                            + ": run `applier sync` first (it copies every published table)")
        tables = _published(cfg, names)
        run = uuid.uuid4().hex
        for t in tables:
            _begin_table(cfg, target, t, run, force, say)
        return _copy_at_new_snapshot(cfg, target, tables, run, partitions or cfg.spark["partitions"], spark,
                                     reporter, say)
    finally:
        target.close()


def _published(cfg: Config, names: list[str]) -> list[SourceTable]:
    """The named source tables as the publications publish them; SyncError naming each one that is not."""
    published = {(t.schema, t.name): t for t in read_tables_in_snapshot(cfg, None)}
    pubs = ", ".join(cfg.source["publications"])
    out: list[SourceTable] = []
    problems = []
    with source_connect(cfg) as conn:
        for n in dict.fromkeys(names):
            schema, table = split_name(n)
            if (schema, table) in published:
                out.append(published[(schema, table)])
                continue
            found = conn.execute("SELECT 1 FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace "
                                 "WHERE s.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
                                 [schema, table]).fetchone()
            problems.append(f"source table {schema}.{table} is not published by {pubs} "
                            f"({cfg.where('source', 'publications')}): ALTER PUBLICATION … ADD TABLE {schema}.{table} "
                            f"first" if found else f"source table {schema}.{table} does not exist")
    if problems:
        raise SyncError("\n".join(problems))
    return out


def _row(target: TargetDb, name: str, t: SourceTable) -> tuple[Any, ...] | None:
    """(state, snapshot_lsn, started_at, finished_at) of a table's applier_sync_tables row, or None."""
    ph = target.ph
    rows = target.execute(f"SELECT state, snapshot_lsn, started_at, finished_at FROM applier_sync_tables "
                          f"WHERE name = {ph} AND schema_name = {ph} AND table_name = {ph}", [name, t.schema, t.name])
    return rows[0] if rows else None


def _begin_table(cfg: Config, target: TargetDb, t: SourceTable, run: str, force: bool, say: Any) -> None:
    """Step 1: the table's row to 'init', then its target table created (or emptied)."""
    name, ph = cfg.apply["name"], target.ph
    row = _row(target, name, t)
    exists = target.exists(t)
    shown = target.name_of(t)[0]
    if row is not None and row[0] == "ready" and not force:
        raise SyncError(f"source table {t.qualified} joined the stream at {row[1]} ({row[3]}): `applier run` / "
                        f"`catchup` apply its changes. Use --force to copy it again (empties target table {shown}; "
                        f"stop `applier run` first)")
    if row is None and exists and not force:
        raise SyncError(f"target table {shown} exists, but not from `applier sync --table {t.qualified}`: "
                        f"`applier run` may have applied changes to it. Use --force to empty it and copy it "
                        f"(stop `applier run` first)")
    if exists and (row is None or row[0] == "ready"):  # --force
        holder = target_holder(target.dialect, target.conn, target.where, name)
        if holder is not None:
            raise SyncError(f"--force empties target table {shown}, but an applier applies to this target for "
                            f"apply.name {name!r} and may apply changes to that table: {holder}; stop it first")
    if row is not None and row[0] != "ready":
        say(f"restarting the interrupted copy of {t.qualified} ({row[0]}, started {row[2]}): target table {shown} "
            f"is emptied and copied again at a new snapshot")
    key = [name, t.schema, t.name]
    target.transaction([
        (f"DELETE FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} AND table_name = {ph}", key),
        (f"INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run, started_at) "
         f"VALUES ({ph}, {ph}, {ph}, 'init', {ph}, {ph})", [*key, run, _now()]),
    ], durable=True)
    try:
        for created in target.prepare([t]).created:
            say(f"created target table {created}")
    except BaseException:
        if row is None:  # nothing joins: as before
            target.transaction([(f"DELETE FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} "
                                 f"AND table_name = {ph}", key)])
        raise
    if exists:
        target.empty_tables([t])


def temporary_slot_name(name: str, run: str) -> str:
    """The temporary slot of one ``sync --table`` run (a valid slot name: a-z, 0-9, _; at most 63)."""
    safe = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in name.lower())[:30]
    return f"applier_add_{safe}_{os.getpid()}_{run[:8]}"


def _copy_at_new_snapshot(cfg: Config, target: TargetDb, tables: list[SourceTable], run: str, nparts: int,
                          spark: Any, reporter: Any, say: Any) -> SyncResult:
    """Steps 2 to 4 (see the module header)."""
    # start-up time: spark.copy loads pyspark
    from applier.migrate.spark.copy import CopyError

    name, ph = cfg.apply["name"], target.ph
    slot = temporary_slot_name(name, run)
    try:
        ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
    except SourceError as exc:
        raise SyncError(f"{cfg.where('source', 'dsn')}: {exc}") from None
    try:
        try:
            info = ws.create_slot(slot, snapshot="export", temporary=True)
        except SourceError as exc:
            raise SyncError(f"{cfg.where('source', 'dsn')}: cannot create the temporary slot {slot!r}: {exc}") from None
        at = info.consistent_point
        say(f"temporary slot {slot!r} created; snapshot {info.snapshot_name} at {at}")
        in_snapshot = {t.qualified: t for t in read_tables_in_snapshot(cfg, info.snapshot_name)}
        now = [in_snapshot.get(t.qualified) for t in tables]
        if any(t is None for t in now) or _signature([t for t in now if t is not None]) != _signature(tables):
            raise SyncError("the published tables changed while `applier sync --table` started; run it again")
        target.transaction([(f"UPDATE applier_sync_tables SET state = 'copying', snapshot_lsn = {ph} "
                             f"WHERE name = {ph} AND run = {ph}", [str(at), name, run])], durable=True)
        result = SyncResult("table", slot, at)
        if spark is None and target.dialect != "sqlite":  # a SQLite target is copied by the driver alone
            spark = spark_for(cfg)
        started = time.monotonic()
        failed: list[str] = []
        with source_connect(cfg) as poll:
            for i, table in enumerate(tables):
                try:
                    result.tables.append(_copy_table(cfg, target, table, i, run, info.snapshot_name, nparts, spark,
                                                     reporter, say, poll))
                except CopyError as exc:  # the other tables are still copied, every failure is reported
                    failed.append(str(exc))
                    say(f"{exc}; going on with the other tables")
                    continue
                _ready(target, name, run, table)
        result.copy_seconds = time.monotonic() - started
        if failed:
            raise SyncError(f"{len(failed)} of {len(tables)} tables could not be copied (the others joined the "
                            f"stream at {at}); the failed ones stay 'copying', and `applier run` holds their changes "
                            f"from {at} on: fix the cause and run `applier sync --table` again for them:\n  "
                            + "\n  ".join(failed))
        say(f"{len(tables)} table{'s' if len(tables) > 1 else ''} copied at {at} and joined to the stream: "
            f"`applier run` / `catchup` apply their changes from there on")
        return result
    except (psycopg.Error, sqlite3.Error) as exc:
        raise SyncError(f"`applier sync --table` failed: {one_line(exc)}") from None
    finally:
        ws.close()  # the temporary slot goes with it


def _ready(target: TargetDb, name: str, run: str, table: SourceTable) -> None:
    """Step 4 for one table: 'ready', its partitions forgotten; durable (the copy's commits are flushed with it)."""
    ph = target.ph
    target.transaction([
        (f"UPDATE applier_sync_tables SET state = 'ready', finished_at = {ph} WHERE name = {ph} AND run = {ph} "
         f"AND schema_name = {ph} AND table_name = {ph}", [_now(), name, run, table.schema, table.name]),
        (f"DELETE FROM applier_sync_parts WHERE name = {ph} AND run = {ph} AND tbl = {ph}",
         [name, run, table.qualified]),
    ], durable=True)

