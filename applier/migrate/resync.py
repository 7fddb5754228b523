"""``applier resync``: a replica whose slot was lost brought back by repair at a new slot's snapshot, not by a re-copy.

After the clear stop on a missing or invalidated slot (``SlotLost``, exit 6), ``resync(cfg)``:

1. claims the progress row (``applier.targets.claim``: no applier may apply meanwhile) and each published table's
   copy (``claim.copy_claim_name``: no ``repair`` or ``sync --table`` of it runs); refuses a slot that is not lost
   (``admin.lost_slot``: nothing to do, ``applier run`` follows it), a table whose copy or repair is unfinished (its
   ``applier_sync_tables`` row not 'ready': finish that first);
2. drops the invalidated slot (a dropped one is gone already) and creates the slot again, with ``SNAPSHOT 'export'``:
   its consistent point C and a snapshot seeing exactly the transactions committed before C. With
   ``source.two_phase``, the transactions the target holds prepared from the lost slot are dead now (a
   PostgreSQL target's ``PREPARE TRANSACTION`` under applier's gid, holding row locks the rewrite would wait for;
   or the changes kept in ``applier_prepared``): each one's COMMIT or ROLLBACK PREPARED came after the applied
   position, so only the lost slot would have sent it. None is prepared on the source at C (a logical slot is
   made only once every transaction running, prepared ones included, has ended): one the source committed is in
   C's snapshot, one it rolled back is nowhere. So the target's are rolled back (the kept ones deleted with
   the progress row's move, step 4) before anything is rewritten, and the count said;
3. repairs every published table against that snapshot (``applier.migrate.repair``: verify's key-range hashes,
   each differing range rewritten whole in one target transaction and recorded in ``applier_repairs``). No applier
   runs, so nothing is held: each table is then the source at C. The changes the lost slot never delivered (those
   after the applied position and before C) are exactly differences at C, so exactly what is rewritten;
4. in one durable transaction: the progress row moved to C on the new slot (``recopy_needed`` cleared), the lost
   slot and the position applied from it in ``resynced_from``, the time in ``resynced_at`` (migration 0009), and
   the changes held for tables being copied (``applier_held``, all from the lost slot's stream, before C: in the
   repaired tables) deleted, and the copy's ``finished_at`` (``applier_sync``'s and the tables' rows) set to the
   target server's time: the rows rewritten are the copy's, not foreign to conflict detection (a PostgreSQL
   target's rows last written without the origin after that time are). ``applier run`` then follows the new slot from C: every transaction committed after
   C once, none before it again.

A resync that fails or is killed before step 4 leaves the progress row where it was: the new slot is dropped when
it fails (a killed one's slot, never streamed from, is found and made again by the next run, which repairs
against its own snapshot); the ranges already rewritten are whole and recorded. Run it again.

Not done here: DDL capture's kept shapes are not re-read at C (``applier_ddl_tables`` keeps the last shapes it
followed; a DDL in the gap is seen at its next change, as without capture).
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from applier.admin import check_source, check_target, lost_slot, read_progress, upgrade_control_tables
from applier.config import Config
from applier.errors import InUseError, SlotLost
from applier.migrate.repair import RepairError, RepairReport, claim_table, compare_table, rewrite_ranges
from applier.migrate.spark.session import spark_for
from applier.migrate.sync import TargetDb, _now, read_tables_in_snapshot, slot_row
from applier.progress.store import RESYNC_STARTED
from applier.source.base import SourceError
from applier.source.walsender import WalSender
from applier.targets.claim import Held
from applier.text import one_line


def resync(cfg: Config, *, spark: Any = None, say: Callable[[str], None] | None = None) -> RepairReport:
    """Bring back a replica whose slot is lost (see the module header); the repair's report (at the new slot's
    start)."""
    say = say or (lambda line: None)
    try:
        return _resync(cfg, spark, say)
    except (psycopg.Error, sqlite3.Error) as exc:
        raise RepairError(f"`applier resync` failed: {one_line(exc)}") from None


def _resync(cfg: Config, spark: Any, say: Callable[[str], None]) -> RepairReport:
    name, slot = cfg.apply["name"], cfg.source["slot"]
    check_source(cfg, need_slot=False)
    revision = check_target(cfg, need_init=False)
    if line := upgrade_control_tables(cfg, revision):
        say(line)
    target = TargetDb(cfg)
    claims: list[Held | None] = []
    try:
        try:
            target.claim("resync")
        except InUseError:
            holder = target.holder(name) or "a process that has since ended; try again"
            raise InUseError(f"an applier applies to this target for apply.name {name!r}: {holder}; `applier resync` "
                             f"needs it stopped") from None
        progress = read_progress(cfg)
        lost = lost_slot(cfg, progress)
        ph = target.ph
        started = target.execute(f"SELECT resynced_from FROM applier_progress WHERE name = {ph} "
                                 f"AND resynced_at IS NULL AND resynced_from LIKE {ph}", [name, f"{RESYNC_STARTED}%"])
        if lost is None and started:  # a resync that did not end made the slot: made again
            lost = SlotLost(slot, started[0][0][len(RESYNC_STARTED):])
        if lost is None:
            raise RepairError(f"{cfg.where('source', 'slot')}: slot {slot!r} is not lost (or nothing was applied from "
                              f"it yet): `applier run` follows it; `applier repair` mends tables that differ")
        tables = read_tables_in_snapshot(cfg, None)
        claims = [claim_table(target, name, t) for t in tables]
        unfinished = target.execute(f"SELECT schema_name, table_name, state FROM applier_sync_tables "
                                    f"WHERE name = {ph} AND state <> 'ready' ORDER BY 1, 2", [name])
        if unfinished:
            raise RepairError("tables whose copy or repair is unfinished: " + ", ".join(
                f"{s}.{t} ({st})" for s, t, st in unfinished) + ": run `applier sync --table` (a copy) or `applier "
                "repair --table` (a repair) for them first; a resync repairs every table only once they are ready")
        lost_what = lost.what if not started else started[0][0][len(RESYNC_STARTED):]
        target.transaction([(f"UPDATE applier_progress SET resynced_from = {ph}, resynced_at = NULL WHERE name = {ph}",
                             [RESYNC_STARTED + lost_what, name])], durable=True)
        try:
            ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
        except SourceError as exc:
            raise RepairError(f"{cfg.where('source', 'dsn')}: {exc}") from None
        made = False
        try:
            try:
                if slot_row(cfg) is not None:
                    ws.drop_slot(slot)  # invalidated (or made by a resync killed before it ended): made again
                ident = ws.identify_system()
                info = ws.create_slot(slot, two_phase=cfg.source["two_phase"], snapshot="export",
                                      failover=cfg.source["failover"])
            except SourceError as exc:
                raise RepairError(f"{cfg.where('source', 'slot')}: {exc}") from None
            made = True
            at = info.consistent_point
            assert info.snapshot_name is not None  # asked for (SNAPSHOT 'export')
            say(f"slot {slot!r} {lost_what} with the target at {progress.lsn}: made again at {at}; repairing every "
                f"published table against its snapshot")
            kept = int(target.execute(f"SELECT count(*) FROM applier_prepared WHERE name = {ph}", [name])[0][0])
            dead = target.backend.roll_back_prepared(target.conn, name) + kept
            if dead:
                say(f"{dead} transactions prepared on the target from the lost slot rolled back: their COMMIT or "
                    f"ROLLBACK PREPARED is lost with it, and a commit's effect is in the new slot's snapshot")
            if spark is None:
                spark = spark_for(cfg)
            report = RepairReport(str(at), False)
            run = uuid.uuid4().hex
            for t in read_tables_in_snapshot(cfg, info.snapshot_name):
                say(f"comparing {t.qualified}")
                found = compare_table(cfg, target, spark, t, info.snapshot_name)
                if found.ranges:
                    rewrite_ranges(cfg, target, t, found, info.snapshot_name, str(at), run, say)
                    found.rewritten = True
                report.tables.append(found)
            sql = target.backend.sql
            target.transaction([
                (sql.upsert, [name, str(at), None, ident["systemid"], slot, int(ident["timeline"] or 0) or None]),
                (sql.clear_skip, [name]),
                (f"UPDATE applier_progress SET resynced_from = {ph}, resynced_at = {ph} WHERE name = {ph}",
                 [f"slot {slot!r} {lost_what}, applied up to {progress.lsn}", _now(), name]),
                (f"DELETE FROM applier_held WHERE name = {ph}", [name]),
                (f"DELETE FROM applier_prepared WHERE name = {ph}", [name]),  # dead (step 2)
                # the rewritten rows are the copy's, not foreign (``_copied_at``): by the target server's clock
                (f"UPDATE applier_sync SET finished_at = CURRENT_TIMESTAMP WHERE name = {ph}", [name]),
                (f"UPDATE applier_sync_tables SET finished_at = CURRENT_TIMESTAMP WHERE name = {ph}", [name]),
            ], durable=True)
            made = False
            say(f"resynced: the target is at {at} on slot {slot!r}; `applier run` / `catchup` continue from there")
            return report
        except BaseException:
            if made:  # its snapshot ends with the connection: the slot is useless, a rerun makes it again
                ws.close()
                try:
                    with WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"]) as again:
                        again.drop_slot(slot)
                except SourceError as exc:
                    say(f"slot {slot!r} made by this resync could not be dropped ({exc}); the next resync does it")
            raise
        finally:
            ws.close()
    finally:
        target.close()
        for claim in claims:
            if claim is not None:
                claim.release()
