"""A table added to a running replica: the library function behind ``applier sync --table``.

``sync_tables(cfg, ["schema.table", ...])`` copies tables that were added to the
publications (or whose publication was added to ``source.publications``) after
the full ``applier sync`` (or ``applier init`` of a target made by pg_dump), and joins them to the stream without a gap or a
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
   (``applier.migrate.sync.copy_tables``: partitions recorded in
   ``applier_sync_parts`` with their rows), then the keys its creation left
   for after the copy built (the engine applies its changes only once it is
   'ready', step 4, and binds it again then: with its keys);
4. each copied table's row set to 'ready' (durable: the copy's commits are
   flushed with it), with, when DDL capture is installed in the snapshot, its
   shape at S kept in ``applier_ddl_tables``. The temporary slot ends with its
   connection.

The engine (``applier.engine.apply``) skips a joining table's changes of source
transactions committed before S (they are in the copy) and applies the later
ones once the table is 'ready'; until then they are held on the target
(``applier.engine.holding``) and ``applier run`` goes on with the other tables.

Each table's copy is *claimed* for the whole command (``claim.copy_claim_name``: an advisory lock on
the target connection, a lock file beside a SQLite target) before its row is written: a second
``sync --table`` of the table is refused naming the first, a full ``applier sync`` that starts
meanwhile stops, and an applier waiting on a row 'init'/'copying' that nobody claims says that the
copy is dead (``catchup`` fails with that line). The rows' UPDATEs must each find this run's row, or
the command stops ("another `applier sync` took over").

The applier streaming from the slot now must stream a publication of each table (read from its
walsender's ``START_REPLICATION`` command in ``pg_stat_activity``): one started before the
publication was added to ``source.publications`` would pass S without the table's changes. When no
applier streams, the command says which publications ``applier run`` must be started with.

Refused, one line each: a target that is no replica yet (neither a completed full sync nor the progress row
``applier init`` writes: a target made by pg_dump, then init, is one) or whose full sync is interrupted or
running, a two-phase
config (a prepared transaction is applied before its commit LSN is known, so
it cannot be placed against S; PostgreSQL's ``ALTER SUBSCRIPTION … REFRESH
PUBLICATION`` refuses ``copy_data`` with ``two_phase`` too), a table that is
not published by the configured publications. A table whose row is 'init' or
'copying' (an interrupted run) is emptied and copied again. A target table
that exists without a row, or one already 'ready', is refused unless ``force``;
with ``force`` the progress row is claimed (``applier run`` may have applied
changes to that table already: it must be stopped) until the row is 'init' and
the table emptied, so that an applier starting then sees the row.
"""

from __future__ import annotations

import os
import re
import sqlite3
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from applier.admin import check_source, check_target, source_connect, upgrade_control_tables
from applier.config import Config
from applier.ddl.shape import TableShape
from applier.errors import InUseError
from applier.lsn import LSN
from applier.migrate.schema import SourceTable
from applier.migrate.spark.progress import Reporter
from applier.migrate.sync import (
    SyncError,
    SyncResult,
    TargetDb,
    _now,
    _signature,
    copy_tables,
    read_tables_in_snapshot,
    shapes_in_snapshot,
)
from applier.progress.store import shape_row
from applier.source.base import SourceError
from applier.source.walsender import WalSender
from applier.targets.claim import Held, copy_claim_name
from applier.text import one_line, quote_ident, shell_command


def sync_tables(cfg: Config, names: list[str], *, force: bool = False, spark: Any = None, reporter: Any = None,
                say: Any = None, partitions: int | None = None) -> SyncResult:
    """Copy the source tables ``names`` ("schema.table"; a bare name is in ``public``) and join them to the stream
    (see the module header); the result's ``consistent_point`` is the copy's snapshot point S."""
    say = say or (lambda line: None)
    reporter = reporter or Reporter()
    try:
        return _sync_tables(cfg, names, force, spark, reporter, say, partitions)
    except (psycopg.Error, sqlite3.Error) as exc:  # a lock wait cancelled, a SQLite file busy too long, ...
        raise SyncError(f"`applier sync --table` failed: {one_line(exc)}") from None
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
    revision = check_target(cfg, need_init=False)
    if line := upgrade_control_tables(cfg, revision):
        say(line)
    target = TargetDb(cfg)
    claims: list[Held | None] = []
    try:
        need_replica(target, name)
        tables = published_tables(cfg, names)
        claims = [_claim_copy(target, name, t) for t in tables]
        need_replica(target, name)  # again, claimed: a full sync that starts now sees the claims and stops
        _check_streamed(cfg, tables, say)
        run = uuid.uuid4().hex
        for t in tables:
            _begin_table(cfg, target, t, run, force, say)
        return _copy_at_new_snapshot(cfg, target, tables, run, partitions or cfg.spark["partitions"], spark,
                                     reporter, say)
    finally:
        target.close()  # a PostgreSQL target's claims go with its connection
        for claim in claims:
            if claim is not None:
                claim.release()


def need_replica(target: TargetDb, name: str, command: str = "applier sync --table") -> None:
    """SyncError unless the target is a replica for ``name`` that a joined table can follow: its full sync done, or
    no sync at all and the progress row there (``applier init`` writes it: a target made by pg_dump, then init);
    ``command`` is the one refused (``applier repair`` joins tables too)."""
    state = target.sync_state(name)
    if state is not None and state["state"] == "done":
        return
    if state is not None:
        raise SyncError(f"`{command}` works on a replica, but for apply.name {name!r} the full sync "
                        f"is {state['state']} (interrupted or running): let it end, or run `applier sync` again")
    # the row alone, none of its columns: a ``repair --dry-run`` reads control tables older than the head as they are
    if not target.execute(f"SELECT 1 FROM applier_progress WHERE name = {target.ph}", [name]):
        raise SyncError(f"`{command}` works on a replica, but for apply.name {name!r} this target "
                        f"is none yet (no sync has run, and no progress row from `applier init`): run `applier sync` "
                        f"first (it copies every published table), or `applier init` when the tables are on the "
                        f"target already (made by pg_dump)")


def claim_copy(target: TargetDb, name: str, t: SourceTable, by: str,
               refused: Callable[[str], Exception]) -> Held | None:
    """Claim the copy of ``t`` (``claim.copy_claim_name``) for the command ``by``, held until it ends: a second
    ``sync --table`` or ``repair`` of the table is refused naming this one, and an applier waiting for the copy
    knows that it runs. If another has it: ``refused(its holder)`` is raised."""
    key = copy_claim_name(name, t.schema, t.name)
    try:
        return target.backend.claim(target.conn, target.where, key, by)
    except InUseError:
        raise refused(target.holder(key) or "a process that has since ended; try again") from None


def _claim_copy(target: TargetDb, name: str, t: SourceTable) -> Held | None:
    return claim_copy(target, name, t, "sync --table", lambda holder: SyncError(
        f"another `applier sync --table` is copying source table {t.qualified} to this target for apply.name "
        f"{name!r}: {holder}; let it end (or stop it) first"))


def _check_streamed(cfg: Config, tables: list[SourceTable], say: Any) -> None:
    """SyncError if the applier streaming from the slot now does not stream a publication of each table: its
    position would pass the copy's snapshot without the table's changes, which would then be lost. The running
    stream's publications are read from its walsender's command (``pg_stat_activity.query``)."""
    slot, pubs = cfg.source["slot"], cfg.source["publications"]
    with source_connect(cfg) as conn:
        row = conn.execute("SELECT a.pid, a.query FROM pg_replication_slots s JOIN pg_stat_activity a "
                           "ON a.pid = s.active_pid WHERE s.slot_name = %s", [slot]).fetchone()
        if row is None:
            say(f"no applier streams from slot {slot!r} now (stopped, or waiting for a table): make sure `applier "
                f"run` runs with source.publications {', '.join(pubs)}, or the copied tables' changes are lost")
            return
        pid, query = row
        m = re.search(r"\"?publication_names\"?\s+'((?:[^']|'')*)'", query or "")
        if m is None:
            say(f"cannot tell which publications the applier streaming from slot {slot!r} (walsender pid {pid}) "
                f"was started with (its command is not visible to this role): make sure they include the copied "
                f"tables' ({', '.join(pubs)})")
            return
        streamed = [a or b.replace('""', '"') for a, b in
                    re.findall(r'([^",]+)|"((?:[^"]|"")*)"', m[1].replace("''", "'"))]
        missing = []
        for t in tables:
            by = [r[0] for r in conn.execute("SELECT pubname FROM pg_publication_tables WHERE pubname = ANY(%s) "
                                             "AND schemaname = %s AND tablename = %s", [pubs, t.schema, t.name])]
            if not set(by) & set(streamed):
                missing.append(f"{t.qualified} ({', '.join(by)})")
    if missing:
        raise SyncError(f"the applier streaming from slot {slot!r} (walsender pid {pid}) streams publications "
                        f"{', '.join(streamed)}, which do not publish " + ", ".join(missing) + ": its position "
                        f"would pass the copy without their changes. Restart `applier run` (it reads "
                        f"{cfg.where('source', 'publications')} when it starts), then run `applier sync --table` "
                        f"again")


def published_tables(cfg: Config, names: list[str]) -> list[SourceTable]:
    """The named source tables as the publications publish them, each once however often or however it is named
    ("t" and "public.t"); SyncError naming each one that is not."""
    published = {(t.schema, t.name): t for t in read_tables_in_snapshot(cfg, None)}
    pubs = ", ".join(cfg.source["publications"])
    out: list[SourceTable] = []
    problems = []
    with source_connect(cfg) as conn:
        for schema, table in dict.fromkeys(split_name(n) for n in names):
            if (schema, table) in published:
                out.append(published[(schema, table)])
                continue
            found = conn.execute("SELECT c.relkind FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace "
                                 "WHERE s.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
                                 [schema, table]).fetchone()
            leaves = [] if found is None or found[0] != "p" else [r[0] for r in conn.execute(
                "SELECT DISTINCT p.schemaname || '.' || p.tablename FROM pg_partition_tree(%s::regclass) t "
                "JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace s ON s.oid = c.relnamespace "
                "JOIN pg_publication_tables p ON p.schemaname = s.nspname AND p.tablename = c.relname "
                "WHERE p.pubname = ANY(%s) ORDER BY 1",
                [quote_ident(schema) + "." + quote_ident(table), cfg.source["publications"]])]
            if leaves:
                problems.append(f"source table {schema}.{table} is partitioned and published through its partitions "
                                f"{', '.join(leaves)} by {pubs} (publish_via_partition_root = false): give those to "
                                f"--table, or set publish_via_partition_root = true")
            else:
                problems.append(f"source table {schema}.{table} is not published by {pubs} "
                                f"({cfg.where('source', 'publications')}): ALTER PUBLICATION … ADD TABLE "
                                f"{schema}.{table} first" if found else f"source table {schema}.{table} does not exist")
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
        raise SyncError(f"target table {shown} exists, but not from `{shell_command('applier', 'sync', '--table', t.qualified)}`: "
                        f"`applier run` may have applied changes to it. Use --force to empty it and copy it "
                        f"(stop `applier run` first)")
    guard: TargetDb | None = None
    if exists and (row is None or row[0] == "ready"):  # --force: no applier may bind the table without the row
        guard = TargetDb(cfg)
        try:
            guard.claim("sync --table --force")  # held until the row is 'init' and the table emptied
        except InUseError:
            holder = guard.holder(name) or "a process that has since ended; try again"
            guard.close()
            raise SyncError(f"--force empties target table {shown}, but an applier applies to this target for "
                            f"apply.name {name!r} and may apply changes to that table: {holder}; stop it first") \
                from None
    try:
        if row is not None and row[0] != "ready":
            say(f"restarting the interrupted copy of {t.qualified} ({row[0]}, started {row[2]}): target table "
                f"{shown} is emptied and copied again at a new snapshot")
        key = [name, t.schema, t.name]
        target.transaction([
            (f"DELETE FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} AND table_name = {ph}", key),
            (f"INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run, started_at) "
             f"VALUES ({ph}, {ph}, {ph}, 'init', {ph}, {ph})", [*key, run, _now()]),
            # partitions of earlier runs of this table (interrupted ones): never read again
            (f"DELETE FROM applier_sync_parts WHERE name = {ph} AND tbl = {ph} AND run <> {ph}",
             [name, t.qualified, run]),
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
            target.empty_tables([t], f"applier sync --table {t.qualified}")
    finally:
        if guard is not None:
            guard.close()


def temporary_slot_name(name: str, run: str) -> str:
    """The temporary slot of one ``sync --table`` run (a valid slot name: a-z, 0-9, _; at most 63)."""
    safe = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in name.lower())[:30]
    return f"applier_add_{safe}_{os.getpid()}_{run[:8]}"


def _copy_at_new_snapshot(cfg: Config, target: TargetDb, tables: list[SourceTable], run: str, nparts: int,
                          spark: Any, reporter: Any, say: Any) -> SyncResult:
    """Steps 2 to 4 (see the module header)."""
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
        copying = target.transaction([(f"UPDATE applier_sync_tables SET state = 'copying', snapshot_lsn = {ph} "
                                       f"WHERE name = {ph} AND run = {ph}", [str(at), name, run])], durable=True)
        if copying[0] != len(tables):
            raise _taken_over(tables, name)
        result = SyncResult("table", slot, at)
        shapes = {s.oid: s for s in shapes_in_snapshot(cfg, info.snapshot_name, tables, say)}
        failed = copy_tables(cfg, target, tables, run, info.snapshot_name, nparts, spark, reporter, say, result,
                             after=lambda table: _ready(target, name, run, table, at, shapes.get(table.oid)))
        if failed:
            raise SyncError(f"{len(failed)} of {len(tables)} tables could not be copied (the others joined the "
                            f"stream at {at}); the failed ones stay 'copying', and `applier run` holds their changes "
                            f"from {at} on: fix the cause and run `applier sync --table` again for them:\n  "
                            + "\n  ".join(failed))
        say(f"{len(tables)} table{'s' if len(tables) > 1 else ''} copied at {at} and joined to the stream: "
            f"`applier run` / `catchup` apply their changes from there on")
        return result
    finally:
        ws.close()  # the temporary slot goes with it


def _ready(target: TargetDb, name: str, run: str, table: SourceTable, at: LSN, shape: TableShape | None) -> None:
    """Step 4 for one table: 'ready', its partitions forgotten, its shape at the snapshot kept (DDL capture installed);
    durable (the copy's commits are flushed with it)."""
    ph = target.ph
    keep = [] if shape is None else [(target.backend.sql.keep_shape, shape_row(name, shape, at))]
    ready = target.transaction([
        *keep,
        (f"UPDATE applier_sync_tables SET state = 'ready', finished_at = {ph} WHERE name = {ph} AND run = {ph} "
         f"AND schema_name = {ph} AND table_name = {ph}", [_now(), name, run, table.schema, table.name]),
        (f"DELETE FROM applier_sync_parts WHERE name = {ph} AND run = {ph} AND tbl = {ph}",
         [name, run, table.qualified]),
    ], durable=True)
    if ready[0] != 1:
        raise _taken_over([table], name)


def _taken_over(tables: list[SourceTable], name: str) -> SyncError:
    """The run's applier_sync_tables rows are gone or another run's (a full `applier sync --force`, say)."""
    return SyncError(f"another `applier sync` took over {', '.join(t.qualified for t in tables)} for apply.name "
                     f"{name!r} (its applier_sync_tables row is no longer this run's): this copy stops; see "
                     f"`applier status` and run `applier sync --table` again if the table still needs it")

