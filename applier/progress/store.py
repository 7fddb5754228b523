"""The progress row: SQL to read and write it (``progress_sql``, made by each kind of target with its placeholder),
and its value type."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, NamedTuple

from applier.lsn import LSN

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.shape import TableShape

# ``resynced_from`` of a resync that has not ended (its slot made again, the progress row not moved yet)
RESYNC_STARTED = "resync started: slot "
# The newest alembic revision of the control tables (tests check it against migrations/).
HEAD_REVISION = "0010"
VERSION_TABLE = "applier_alembic_version"
# Every control table at HEAD_REVISION, alembic's last (``applier drop --control-tables`` drops them in this order);
# each but ``SHARED_TABLES`` has the ``name`` column of apply.name.
CONTROL_TABLES = ("applier_repairs", "applier_held", "applier_ddl_log", "applier_ddl_tables", "applier_conflicts", "applier_sync_tables",
                  "applier_sync_parts", "applier_sync", "applier_prepared", "applier_progress", "applier_keys_owed",
                  VERSION_TABLE)
# the control tables of every apply.name alike (``applier_keys_owed``: rows of target tables, whichever apply.name's
# sync made them), dropped only with the last apply.name's rows
SHARED_TABLES = ("applier_keys_owed", VERSION_TABLE)


class Progress(NamedTuple):
    """What the target has applied: end LSN of the last source transaction, a pending skip, the source's
    system identifier (IDENTIFY_SYSTEM) and the slot the LSN belongs to (None: not recorded yet), the last
    error an applier met (one line) with its time (ISO 8601, UTC), why the replica needs a re-copy
    (``applier init --new-slot`` after a lost slot; cleared when ``applier sync`` completes), or None, and the
    source's timeline (IDENTIFY_SYSTEM) of the last write (None: not recorded)."""

    lsn: LSN
    commit_time: int | None
    skip_lsn: LSN | None
    source_system: str | None = None
    slot: str | None = None
    last_error: str | None = None
    last_error_at: str | None = None
    recopy_needed: str | None = None
    source_timeline: int | None = None
    resynced_from: str | None = None  # the lost slot a resync replaced (``RESYNC_STARTED``…: one not ended yet)
    resynced_at: str | None = None  # when the resync ended (None: none did)

    @classmethod
    def from_row(cls, row: tuple[Any, ...] | None) -> Progress:
        """From a ``ProgressSQL.select`` row, or the empty progress for no row."""
        if row is None:
            return cls(LSN(0), None, None)
        return cls(LSN.parse(row[0]), row[1], LSN.parse(row[2]) if row[2] else None, *row[3:])


class ProgressSQL(NamedTuple):
    """The statements for one parameter style."""

    select: str
    upsert: str  # a copy's (``applier sync``): sets the position whatever it was, clears ``recopy_needed``
    advance: str  # the engine's: moves the position only from the one read (compare-and-set; see ``_sql``)
    set_recopy: str  # (name, lsn, why): follow from ``lsn``, the replica needs a re-copy (``applier init --new-slot``)
    # (name, source_system, slot): the row of a replica ``applier init`` made, nothing applied yet (0/0); a row there
    # already is kept. ``applier sync --table`` takes the row as the sign that the target follows the slot
    start: str
    set_skip: str
    record_error: str
    clear_skip: str
    store_prepared: str
    load_prepared: str
    delete_prepared: str
    list_prepared: str
    has_sync_tables: str  # one row: whether applier_sync_tables exists (None: a target older than 0003)
    table_join: str  # (name, source schema, source table) -> (state, snapshot_lsn) of applier_sync_tables
    # ``applier repair`` (``applier.migrate.repair``): (name) -> (schema, table, state) of the rows in state 'repair'
    # (a repair asks the running applier to hold the table's changes) or 'repairing' (held: answered by this applier
    # or, when it seemed absent, by the repair itself); (name, schema, table) a 'repair' row set to 'repairing' (the
    # applier holds them from now on: the answer)
    repair_requests: str
    hold_for_repair: str
    repairs_running: str  # (name) -> (schema, table, state, snapshot_lsn, started_at) of the rows a repair holds
    # applier_conflicts (``applier.engine.conflicts``): (name, recorded_at, type, table, key, local, remote, xid,
    # commit_lsn, commit_time, policy, resolution); (name, before) -> rows deleted; (name) -> (type, count) rows
    record_conflict: str
    prune_conflicts: str
    count_conflicts: str
    latest_conflicts: str  # (name, limit) -> the newest rows, newest first
    # applier_ddl_tables (``applier.engine.ddl``): (name) -> (source_oid, shape); (name, oid, schema, table, shape,
    # lsn, at) upserted; (name, oid) deleted. applier_ddl_log: (name, lsn, table, class, result, change, statement,
    # at); (name) -> the newest row (lsn, table, class, result, change, statement, at)
    known_shapes: str
    keep_shape: str
    forget_shape: str
    record_ddl: str
    last_ddl: str
    # applier_held (``applier.engine.holding``): (name, oid, schema, table, commit_lsn, xid, commit_time, changes)
    # added; (name) -> (oid, schema, table, transactions) of each table with held rows; (name, oid, limit) ->
    # (id, commit_lsn, xid, commit_time, changes), the first ``limit`` in the order written; (name, oid, id) the
    # rows up to id deleted
    hold: str
    held_tables: str
    held_changes: str
    forget_held: str
    held_at: str  # (name, commit_lsn) -> a row when a transaction finished there is held


def _upsert(ph: str, also: str = "", where: str = "") -> str:
    """The progress row of (name, lsn, commit_time, source_system, slot, source_timeline) written (a NULL system,
    slot or timeline keeps the one recorded); ``also``: more SET items; ``where``: the condition an existing row
    must meet to be updated."""
    return (f"INSERT INTO applier_progress (name, lsn, commit_time, source_system, slot, source_timeline, "
            f"updated_at) VALUES ({ph}, {ph}, {ph}, {ph}, {ph}, {ph}, CURRENT_TIMESTAMP) "
            f"ON CONFLICT (name) DO UPDATE SET lsn = excluded.lsn, commit_time = excluded.commit_time, "
            f"source_system = coalesce(excluded.source_system, applier_progress.source_system), "
            f"slot = coalesce(excluded.slot, applier_progress.slot), "
            f"source_timeline = coalesce(excluded.source_timeline, applier_progress.source_timeline), "
            f"updated_at = excluded.updated_at{also}{where}")


def progress_sql(ph: str, has_sync_tables: str) -> ProgressSQL:
    """The statements of ``ProgressSQL`` with the parameter marker ``ph``; ``has_sync_tables``: a query whose one
    value says whether the table applier_sync_tables exists."""
    return ProgressSQL(
        select=(f"SELECT lsn, commit_time, skip_lsn, source_system, slot, last_error, last_error_at, recopy_needed, "
                f"source_timeline, resynced_from, resynced_at FROM applier_progress WHERE name = {ph}"),
        upsert=_upsert(ph, ", recopy_needed = NULL"),
        # (name, lsn, commit_time, source_system, slot, source_timeline, the position read): one row written, or none when another
        # process moved the position since (a row that did not exist is inserted; one inserted meanwhile
        # conflicts, and its position is compared as any)
        advance=_upsert(ph, where=f" WHERE applier_progress.lsn = {ph}"),
        set_recopy=(f"INSERT INTO applier_progress (name, lsn, recopy_needed) VALUES ({ph}, {ph}, {ph}) "
                    f"ON CONFLICT (name) DO UPDATE SET lsn = excluded.lsn, recopy_needed = excluded.recopy_needed"),
        start=(f"INSERT INTO applier_progress (name, lsn, source_system, slot, updated_at) "
               f"VALUES ({ph}, '0/0', {ph}, {ph}, CURRENT_TIMESTAMP) ON CONFLICT (name) DO NOTHING"),
        # (name, error, at): the row may not exist yet (nothing applied)
        record_error=(f"INSERT INTO applier_progress (name, lsn, last_error, last_error_at) "
                      f"VALUES ({ph}, '0/0', {ph}, {ph}) ON CONFLICT (name) DO UPDATE SET "
                      f"last_error = excluded.last_error, last_error_at = excluded.last_error_at"),
        set_skip=(f"INSERT INTO applier_progress (name, lsn, skip_lsn) VALUES ({ph}, '0/0', {ph}) "
                  f"ON CONFLICT (name) DO UPDATE SET skip_lsn = excluded.skip_lsn"),
        clear_skip=f"UPDATE applier_progress SET skip_lsn = NULL WHERE name = {ph}",
        store_prepared=(f"INSERT INTO applier_prepared (name, gid, xid, prepare_lsn, end_lsn, prepare_time, changes) "
                        f"VALUES ({ph}, {ph}, {ph}, {ph}, {ph}, {ph}, {ph}) ON CONFLICT (name, gid) DO UPDATE SET "
                        f"xid = excluded.xid, prepare_lsn = excluded.prepare_lsn, end_lsn = excluded.end_lsn, "
                        f"prepare_time = excluded.prepare_time, changes = excluded.changes"),
        load_prepared=f"SELECT changes FROM applier_prepared WHERE name = {ph} AND gid = {ph}",
        delete_prepared=f"DELETE FROM applier_prepared WHERE name = {ph} AND gid = {ph}",
        list_prepared=f"SELECT gid, xid, prepare_lsn, end_lsn FROM applier_prepared WHERE name = {ph} ORDER BY end_lsn",
        has_sync_tables=has_sync_tables,
        table_join=(f"SELECT state, snapshot_lsn FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} "
                    f"AND table_name = {ph}"),
        repair_requests=(f"SELECT schema_name, table_name, state FROM applier_sync_tables WHERE name = {ph} "
                         f"AND state IN ('repair', 'repairing') ORDER BY schema_name, table_name"),
        hold_for_repair=(f"UPDATE applier_sync_tables SET state = 'repairing' WHERE name = {ph} AND schema_name = {ph} "
                         f"AND table_name = {ph} AND state = 'repair'"),
        repairs_running=(f"SELECT schema_name, table_name, state, snapshot_lsn, started_at FROM applier_sync_tables "
                         f"WHERE name = {ph} AND state IN ('repair', 'repairing') ORDER BY schema_name, table_name"),
        record_conflict=(f"INSERT INTO applier_conflicts (name, recorded_at, conflict_type, table_name, key, local_row, "
                         f"remote_row, xid, commit_lsn, commit_time, policy, resolution) VALUES "
                         f"({', '.join([ph] * 12)})"),
        prune_conflicts=f"DELETE FROM applier_conflicts WHERE name = {ph} AND recorded_at < {ph}",
        count_conflicts=(f"SELECT conflict_type, count(*) FROM applier_conflicts WHERE name = {ph} "
                         f"GROUP BY conflict_type ORDER BY conflict_type"),
        latest_conflicts=(f"SELECT recorded_at, conflict_type, table_name, key, resolution, commit_lsn, xid "
                          f"FROM applier_conflicts WHERE name = {ph} ORDER BY id DESC LIMIT {ph}"),
        known_shapes=f"SELECT source_oid, shape FROM applier_ddl_tables WHERE name = {ph}",
        keep_shape=(f"INSERT INTO applier_ddl_tables (name, source_oid, schema_name, table_name, shape, lsn, updated_at) "
                    f"VALUES ({', '.join([ph] * 7)}) ON CONFLICT (name, source_oid) DO UPDATE SET "
                    f"schema_name = excluded.schema_name, table_name = excluded.table_name, shape = excluded.shape, "
                    f"lsn = excluded.lsn, updated_at = excluded.updated_at"),
        forget_shape=f"DELETE FROM applier_ddl_tables WHERE name = {ph} AND source_oid = {ph}",
        record_ddl=(f"INSERT INTO applier_ddl_log (name, lsn, table_name, ddl_class, result, change, statement, "
                    f"applied_at) VALUES ({', '.join([ph] * 8)})"),
        last_ddl=(f"SELECT lsn, table_name, ddl_class, result, change, statement, applied_at FROM applier_ddl_log "
                  f"WHERE name = {ph} ORDER BY id DESC LIMIT 1"),
        hold=(f"INSERT INTO applier_held (name, source_oid, schema_name, table_name, commit_lsn, xid, commit_time, "
              f"changes) VALUES ({', '.join([ph] * 8)})"),
        held_tables=(f"SELECT source_oid, min(schema_name), min(table_name), count(DISTINCT commit_lsn) FROM applier_held "
                     f"WHERE name = {ph} GROUP BY source_oid ORDER BY source_oid"),
        held_changes=(f"SELECT id, commit_lsn, xid, commit_time, changes FROM applier_held WHERE name = {ph} "
                      f"AND source_oid = {ph} ORDER BY id LIMIT {ph}"),
        forget_held=f"DELETE FROM applier_held WHERE name = {ph} AND source_oid = {ph} AND id <= {ph}",
        held_at=f"SELECT 1 FROM applier_held WHERE name = {ph} AND commit_lsn = {ph} LIMIT 1",
    )




def prune_conflicts(conn: Any, sql: ProgressSQL, name: str, age: int) -> int:
    """Delete ``name``'s applier_conflicts rows recorded more than ``age`` seconds ago, on the DB-API connection
    ``conn`` (in its transaction: the caller commits); how many."""
    before = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cur = conn.execute(sql.prune_conflicts, [name, before])
    return int(cur.rowcount)


def shape_row(name: str, shape: TableShape, lsn: LSN | str) -> list[Any]:
    """The parameters of ``ProgressSQL.keep_shape``: the shape of a followed source table, kept at ``lsn``."""
    return [name, shape.oid, shape.schema, shape.name, shape.to_json(), str(lsn),
            dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")]
