"""Setting up and looking at a replication: init, preflight checks, status, skip.

Library functions behind ``applier init``, ``status`` and ``skip``, and the
checks every command runs before it touches anything: a wrong config (server
unreachable, missing publication or slot, missing privileges, target not
initialized) is one ``ConfigError`` naming the key or object.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import psycopg
from psycopg import sql as psql

from applier.config import Config, ConfigError, ConnectError, parse_age
from applier.decoder.messages import (
    ROW_CHANGES,
    Begin,
    MessageKind,
    StreamCommit,
    StreamStart,
    StreamStop,
    kind_of,
    pg_timestamp,
)
from applier.decoder.pgoutput import decode_message
from applier.errors import SlotLost
from applier.lsn import LSN
from applier.progress.store import HEAD_REVISION, VERSION_TABLE, Progress, ProgressSQL, prune_conflicts, shape_row
from applier.rows import one_row
from applier.source import capture, failover, slothealth
from applier.source.base import SourceError, StreamOptions
from applier.source.walsender import SLOT_STATE, WalSender, slot_state
from applier.targets import opener
from applier.targets.backends import backend_of
from applier.targets.base import utc_now
from applier.targets.claim import ProcessClaim, copy_claim_name
from applier.text import one_line, redact_dsn, redact_text


class SlotMissing(ConfigError):
    """The configured slot does not exist on the source (``check_source``)."""


def source_connect(cfg: Config) -> psycopg.Connection[Any]:
    """An autocommit connection to the source; ConnectError naming the DSN if it fails (a ConfigError if libpq cannot
    read the DSN: an unknown keyword, a missing '=')."""
    try:
        return psycopg.connect(cfg.source["dsn"], autocommit=True, connect_timeout=cfg.source["connect_timeout"])
    except psycopg.ProgrammingError as exc:  # the DSN itself, which no retry mends
        raise ConfigError(f"{cfg.where('source', 'dsn')}: libpq cannot read the DSN "
                          f"({redact_dsn(cfg.source['dsn'])}): {redact_text(one_line(exc))}") from None
    except psycopg.Error as exc:
        raise ConnectError(f"{cfg.where('source', 'dsn')}: cannot connect to the source "
                           f"({redact_dsn(cfg.source['dsn'])}): {redact_text(one_line(exc))}") from None


def check_source(cfg: Config, need_slot: bool = True, conn: psycopg.Connection[Any] | None = None) -> dict[str, Any]:
    """Source reachable, wal_level logical, publications exist, slot exists (if needed), the role may replicate;
    returns facts (``server_version``, ``slot``: see ``check_slot``). On ``conn`` (a ``source_connect`` connection the
    caller keeps open for more) if given, else on a connection of its own. ``applier check`` (``applier.check``) runs
    the same checks one by one."""
    if conn is None:
        with source_connect(cfg) as own:
            return check_source(cfg, need_slot, own)
    refused = failover.refusal(cfg, conn.info.server_version)
    if refused is not None:
        raise refused
    check_wal_level(cfg, conn)
    check_publications(cfg, conn)
    slot = check_slot(cfg, conn, need_slot)
    check_replication_privilege(cfg, conn)
    return {"server_version": conn.info.server_version, "slot": slot}


def check_wal_level(cfg: Config, conn: psycopg.Connection[Any]) -> str:
    """wal_level is logical (ConfigError if not); a line for ``applier check``."""
    wal_level = one_row(conn.execute("SHOW wal_level"))[0]
    if wal_level != "logical":
        raise ConfigError(f"source: wal_level is {wal_level!r}, logical replication needs 'logical'")
    return "logical"


def check_publications(cfg: Config, conn: psycopg.Connection[Any]) -> str:
    """Every configured publication exists (ConfigError naming the first missing one)."""
    have = {r[0] for r in conn.execute("SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                                       [cfg.source["publications"]])}
    for pub in cfg.source["publications"]:
        if pub not in have:
            raise ConfigError(f"{cfg.where('source', 'publications')}: publication {pub!r} does not exist "
                              f"on the source (CREATE PUBLICATION {pub} FOR …)")
    return ", ".join(cfg.source["publications"])


def check_slot(cfg: Config, conn: psycopg.Connection[Any], need_slot: bool = True) -> tuple[Any, ...] | None:
    """The slot is a logical pgoutput slot of this database, and exists if ``need_slot`` (ConfigError if not);
    its row (plugin, slot_type, two_phase, confirmed_flush_lsn, same database, failover: 'true', 'false', or None
    before PostgreSQL 17), None when there is none."""
    row = conn.execute(
        "SELECT plugin, slot_type, two_phase, confirmed_flush_lsn::text, database = current_database(), "
        "to_jsonb(s) ->> 'failover' FROM pg_replication_slots s WHERE slot_name = %s",
        [cfg.source["slot"]]).fetchone()
    if row is None and need_slot:
        raise SlotMissing(f"{cfg.where('source', 'slot')}: replication slot {cfg.source['slot']!r} does not exist "
                          f"on the source (run `applier init`)")
    if row is not None:
        if row[0] != "pgoutput" or row[1] != "logical":
            raise ConfigError(f"{cfg.where('source', 'slot')}: slot {cfg.source['slot']!r} is a {row[1]} slot "
                              f"of plugin {row[0]!r}, not a logical pgoutput slot")
        if not row[4]:
            raise ConfigError(f"{cfg.where('source', 'slot')}: slot {cfg.source['slot']!r} belongs to another "
                              f"database")
    return None if row is None else tuple(row)


def check_replication_privilege(cfg: Config, conn: psycopg.Connection[Any]) -> str:
    """The source role has REPLICATION (or is a superuser); ConfigError if not."""
    priv = conn.execute("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    if not priv or not priv[0]:
        raise ConfigError(f"{cfg.where('source', 'dsn')}: the source role lacks the REPLICATION privilege "
                          f"(ALTER ROLE … REPLICATION)")
    return "REPLICATION"


@contextmanager
def target_db(cfg: Config) -> Iterator[Any]:
    """A DB-API connection to the target (psycopg or sqlite3), committed when the block ends without error.

    The apply commands check the target through this rather than SQLAlchemy, whose import alone
    would add ~0.2 s to every start (see applier.url).
    """
    conn = opener.open(cfg, plain=True)
    try:
        yield conn
        conn.commit()
    finally:
        conn.close()


def _revision(cfg: Config, conn: Any) -> str | None:
    """The control tables' alembic revision (None: never initialized), without importing alembic."""
    if conn.execute(backend_of(cfg).table_exists_sql, [VERSION_TABLE]).fetchone() is None:
        return None
    row = conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone()
    return None if row is None else row[0]


def check_target(cfg: Config, need_init: bool = True, claim: ProcessClaim | None = None) -> str | None:
    """Target reachable and (if needed) its control tables at the newest revision; returns the revision.

    ``claim``: the process's claim (``applier.engine.runner``), handed the checks' connection when they pass if it
    holds one of that kind (``ProcessClaim.adopt``: the claim is then taken on it, a connection fewer); the checks
    then read in autocommit, as the claim's connection is."""
    b = backend_of(cfg)
    missing = b.missing_file(opener.location(cfg))
    if need_init and missing is not None:  # opening a missing file would create it
        raise ConfigError(f"{cfg.where('target', 'url')}: the target's control tables are missing "
                          f"({missing} does not exist); run `applier init`")
    conn = opener.open(cfg, plain=True, autocommit=claim is not None)
    kept = False
    try:
        try:
            rev = _revision(cfg, conn)
            writable = not need_init or rev == HEAD_REVISION and _conflicts_writable(cfg, conn)
        except b.Error as exc:
            raise ConfigError(f"{cfg.where('target', 'url')}: cannot read the target's control tables "
                              f"({redact_dsn(cfg.target['url'])}): {one_line(exc)[:300]}") from None
        conn.commit()
        passed = (not need_init or rev == HEAD_REVISION) and writable
        kept = passed and claim is not None and claim.adopt(conn)
    finally:
        if not kept:
            conn.close()
    if need_init and rev != HEAD_REVISION:
        raise ConfigError(f"{cfg.where('target', 'url')}: the target's control tables are "
                          f"{'missing' if rev is None else f'at revision {rev}'}; run `applier init`")
    if not writable:
        raise ConfigError(f"{cfg.where('target', 'url')}: the target role cannot write table applier_conflicts "
                          f"(where conflicts are recorded); GRANT INSERT, SELECT, DELETE ON applier_conflicts (and "
                          f"USAGE on its id sequence) to it, or run `applier init` if the table is gone")
    return rev


def upgrade_control_tables(cfg: Config, revision: str | None) -> str | None:
    """Bring the target's control tables to the newest revision for a command that writes them (sync, ``sync
    --table``, resync, repair), unless ``revision`` (``check_target``'s) is that already; the line that says what
    was done, None if nothing."""
    if revision == HEAD_REVISION:
        return None
    from applier.progress.migrate import migrate, said  # start-up time: alembic/SQLAlchemy (~0.5 s), when needed

    return said(*migrate(cfg.target["url"]))


def _conflicts_writable(cfg: Config, conn: Any) -> bool:
    """Whether the target role may add rows to applier_conflicts (a conflict is recorded in the transaction of its
    change: without it the apply would stop at the first one, after applying what came before)."""
    return bool(conn.execute(backend_of(cfg).conflicts_writable_sql).fetchone()[0])


def init(cfg: Config, new_slot: bool = False) -> list[str]:
    """Migrate the control tables and create the slot if missing; returns what was done, a line each.

    A slot the progress row has applied from that is gone or invalidated is refused (SlotLost naming the gap):
    a new slot starts at the source's position now, and the changes since the applied position would never
    reach the replica. ``new_slot``: make it anyway (an invalidated one is dropped first), move the progress row to
    its start (the appliers follow from there) and record on it that the replica needs a re-copy (``applier
    status`` says so until ``applier sync`` completes)."""
    done = []
    facts = check_source(cfg, need_slot=False)
    check_target(cfg, need_init=False)
    if cfg.source["two_phase"] and backend_of(cfg).can_prepare and cfg.target["two_phase_mode"] == "prepare":
        check_prepared_allowed(cfg)
    from applier.progress.migrate import migrate, said  # start-up time: alembic/SQLAlchemy (status/skip need not)

    before, after = migrate(cfg.target["url"])
    done.append(said(before, after) or f"control tables: already at {after}")
    slot = cfg.source["slot"]
    progress = read_progress(cfg)
    lost = lost_slot(cfg, progress)
    if lost is not None and not new_slot:
        with source_connect(cfg) as conn:
            now = one_row(conn.execute("SELECT pg_current_wal_lsn()::text"))[0]
        raise SlotLost(slot, f"{lost.what}; a new slot would start at the source's position now ({now}), so the "
                             f"changes between {progress.lsn} and it would never reach the replica", str(progress.lsn))
    system: str | None = None  # the source's system identifier, read when the slot is made
    if facts["slot"] is None or lost is not None:
        ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
        try:
            if lost is not None and facts["slot"] is not None:  # invalidated: nothing can stream from it again
                ws.drop_slot(slot)
                done.append(f"slot {slot!r}: dropped (it {lost.what})")
            system = ws.identify_system()["systemid"]
            info = ws.create_slot(slot, two_phase=cfg.source["two_phase"], snapshot="export",
                                  failover=cfg.source["failover"])
            # while the walsender is open its snapshot is the slot's start: the tables' shapes as of there
            try:
                kept: int | str = _keep_shapes_at(cfg, info.snapshot_name, info.consistent_point)
            except psycopg.Error as exc:  # the slot is made: the shapes are then learnt from the stream
                kept = one_line(exc)
        except SourceError as exc:
            raise ConfigError(f"{cfg.where('source', 'slot')}: {exc}") from None
        finally:
            ws.close()
        done.append(f"slot {slot!r}: created at {info.consistent_point}")
        if isinstance(kept, str):
            done.append(f"DDL capture: the tables' shapes at {info.consistent_point} could not be read ({kept}); "
                        f"they are learnt from the stream")
        elif kept:
            done.append(f"DDL capture: {kept} published table shape(s) kept at {info.consistent_point}")
        if lost is not None:
            why = (f"slot {slot!r} {lost.what} with the target at {progress.lsn}; `applier init --new-slot` made it "
                   f"again at {info.consistent_point} on {utc_now()}: the source's changes in between are not on the "
                   f"replica. Copy the tables again: `applier sync --force`")
            with target_db(cfg) as conn:
                conn.execute(_progress_sql(cfg).set_recopy, [cfg.apply["name"], str(info.consistent_point), why])
            done.append(f"re-copy needed: {why}")
    else:
        done.append(f"slot {slot!r}: exists (confirmed up to {facts['slot'][3]})")
        if cfg.source["failover"] and facts["slot"][5] == "false":
            with WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"]) as ws:
                given = failover.give_failover(cfg, ws, facts["slot"][5])
            if given is not None:
                done.append(given[1])
    if progress.lsn == 0 and progress.slot is None:
        # the progress row says from here on that this target follows the slot (nothing applied yet: 0/0), as
        # CREATE SUBSCRIPTION makes its origin; `applier sync --table` joins tables only to such a replica
        with target_db(cfg) as conn:
            conn.execute(_progress_sql(cfg).start, [cfg.apply["name"], system, slot])
    return done


def _keep_shapes_at(cfg: Config, snapshot: str | None, at: LSN) -> int:
    """With DDL capture installed on the source, keep each published table's shape as the exported ``snapshot`` (the
    new slot's start ``at``) sees it in the target's ``applier_ddl_tables`` (a shape already kept is left), so the
    first captured DDL after ``at`` is compared with the shape the stream starts from; how many were kept. Nothing
    when capture is not installed or no snapshot was exported."""
    if snapshot is None:
        return 0
    with source_connect(cfg) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(psql.SQL("SET TRANSACTION SNAPSHOT {}").format(psql.Literal(snapshot)))
        oids = [int(r[0]) for r in conn.execute(
            "SELECT DISTINCT format('%%I.%%I', schemaname, tablename)::regclass::oid FROM pg_publication_tables "
            "WHERE pubname = ANY(%s)", [cfg.source["publications"]]).fetchall()]
        shapes = capture.shapes(conn, oids) or []
        conn.execute("ROLLBACK")
    if not shapes:
        return 0
    sql = _progress_sql(cfg)
    name = cfg.apply["name"]
    with target_db(cfg) as conn:
        have = {int(r[0]) for r in conn.execute(sql.known_shapes, [name]).fetchall()}
        new = [s for s in shapes if s.oid not in have]
        for s in new:
            conn.execute(sql.keep_shape, shape_row(name, s, at))
    return len(new)


def lost_slot(cfg: Config, progress: Progress) -> SlotLost | None:
    """The SlotLost of the slot the progress row has applied from (None: nothing applied, another slot's or another
    cluster's progress (the appliers refuse those), or the slot is there and streams)."""
    slot = cfg.source["slot"]
    if not progress.lsn or progress.slot not in (None, slot):
        return None
    with source_connect(cfg) as conn:
        if progress.source_system is not None:
            try:
                system = one_row(conn.execute("SELECT system_identifier::text FROM pg_control_system()"))[0]
            except psycopg.Error:  # a role that may not read it: taken as the same cluster
                system = progress.source_system
            if system != progress.source_system:
                return None
        try:
            slot_state(slot, conn.execute(SLOT_STATE, [slot]).fetchone(), progress.lsn)
        except SlotLost as exc:
            return exc
    return None


def check_prepared_allowed(cfg: Config) -> None:
    """The PostgreSQL target can hold prepared transactions (``two_phase_mode = "prepare"``); ConfigError if not."""
    with opener.open(cfg, plain=True, autocommit=True) as conn:
        n = int(one_row(conn.execute("SHOW max_prepared_transactions"))[0])
    if n == 0:
        raise ConfigError(f"{cfg.where('source', 'two_phase')}: the target has max_prepared_transactions = 0; "
                          f"set it above 0 on the target, or target.two_phase_mode = \"table\"")


def _progress_sql(cfg: Config) -> ProgressSQL:
    return backend_of(cfg).sql


def read_progress(cfg: Config) -> Progress:
    """The applied position recorded on the target."""
    with target_db(cfg) as conn:
        return Progress.from_row(conn.execute(_progress_sql(cfg).select, [cfg.apply["name"]]).fetchone())


def skip(cfg: Config, lsn: LSN) -> str:
    """Ask the engine to skip the one transaction finished at ``lsn``; returns a line for the log.

    A transaction finished before the applied position was applied already, and none finished past the source's
    WAL position now: both refused (nothing to skip). A pending skip of another transaction is replaced; the line
    says so, naming it.
    """
    check_target(cfg)
    progress = read_progress(cfg)
    applied = progress.lsn
    with target_db(cfg) as conn:  # a transaction held for a table being copied is applied later: skippable
        held = conn.execute(_progress_sql(cfg).held_at, [cfg.apply["name"], str(lsn)]).fetchone() is not None
    if lsn < applied and not held:
        raise ConfigError(f"--lsn {lsn}: the target is already at {applied}, so the transaction finished at {lsn} "
                          f"was applied (or skipped) before; only a transaction not yet applied can be skipped")
    with source_connect(cfg) as conn:
        current = LSN.parse(one_row(conn.execute("SELECT pg_current_wal_lsn()::text"))[0])
    if lsn > current:
        raise ConfigError(f"--lsn {lsn}: the source's WAL is at {current}, so no transaction finished at {lsn}; "
                          f"give the finish LSN of the failing transaction (the error names it)")
    with target_db(cfg) as conn:
        conn.execute(_progress_sql(cfg).set_skip, [cfg.apply["name"], str(lsn)])
    line = f"the transaction finished at {lsn} will be skipped (once) by the next apply"
    if progress.skip_lsn is not None and progress.skip_lsn != lsn:
        line += f"; this replaces the pending skip of the transaction finished at {progress.skip_lsn}"
    return line


def status(cfg: Config) -> dict[str, Any]:
    """Where the replica stands, for people and scripts (``applier status``).

    - ``applied_lsn``: the target's recorded position (before anything was applied: the slot's
      confirmed position, where the stream starts);
    - ``lag_bytes`` / ``lag_seconds``: 0 when every change the slot has sent is applied; otherwise
      the WAL between the applied position and the source's, and the age of the oldest change not
      yet applied (the first pending transaction's commit time, read without consuming the slot;
      while an applier streams, the walsender's own flush lag);
    - ``running``: who holds the target's progress row now (applier.targets.claim), or null;
    - ``slot_retained_bytes``: the WAL the slot holds back on the source (``pg_current_wal_lsn() -
      restart_lsn``, what fills its disk), with its ``slot_wal_status`` (``lost``: invalidated), and how near it is
      to invalidation (``applier.source.slothealth``): ``slot_safe_wal_size``, ``max_slot_wal_keep_size`` (bytes,
      -1: unlimited), ``slot_idle_seconds`` and ``idle_replication_slot_timeout`` (seconds, 0: off; PostgreSQL 18),
      ``slot_warnings`` (a line each: ``SlotHealth.warnings``);
    - ``failover`` (with ``source.failover``): what ``applier.source.failover.readiness`` found (its ``warnings``:
      what the slot lacks to survive a promotion), or the ``error`` of a source older than PostgreSQL 17;
      ``source_timeline``: the source's timeline the progress was last written on;
    - ``recopy_needed``: why the replica needs a re-copy (``applier init --new-slot`` after a lost slot), until
      ``applier sync`` completes one;
    - ``resynced``: after ``applier resync``, the lost slot and the position applied from it (``from``) and when the
      replica was resynced onto the new slot (``at``; null: a resync started and did not end), or null;
    - ``repairs``: the tables under repair (``applier repair``: applier_sync_tables 'repair' or 'repairing'): table,
      state, snapshot LSN (null before it is taken), since when, and ``by`` who holds the repair's claim (null: no
      repair runs for it any more, killed or failed: rerun it);
    - the last error and when, prepared transactions waiting, a pending skip;
    - ``held``: the tables being copied whose changes are held meanwhile (applier_held, ``applier.engine.holding``):
      table and source transactions held;
    - ``last_ddl``: the last schema change applied or skipped (``apply.schema_changes = "follow"``, applier_ddl_log):
      its LSN, table, class, result, change, the source's statement and when, or null.
    ``slot_exists`` False is what the CLI turns into a non-zero exit; a source that cannot be reached leaves the
    source's fields out, ``slot_exists`` None, and says why in ``error``.
    """
    check_target(cfg)
    progress = read_progress(cfg)
    sql = _progress_sql(cfg)
    with target_db(cfg) as conn:
        repairing = conn.execute(sql.repairs_running, [cfg.apply["name"]]).fetchall()
    target = opener.open(cfg, applying=False)
    try:
        running = target.holder()
        repairs = [{"table": f"{schema}.{table}", "state": state, "snapshot_lsn": lsn, "since": since,
                    "by": target.holder(copy_claim_name(cfg.apply["name"], schema, table))}
                   for schema, table, state, lsn, since in repairing]
    finally:
        target.close()
    out: dict[str, Any] = {"name": cfg.apply["name"], "running": running, "slot": cfg.source["slot"],
                           "applied_lsn": str(progress.lsn)}
    try:
        source = source_connect(cfg)
    except ConnectError as exc:  # what the target says is still printed (``status --json``), with the error
        source, out["error"] = None, str(exc)
    with source or nullcontext() as conn:
        row = None if conn is None else conn.execute(
            "SELECT s.confirmed_flush_lsn::text, s.restart_lsn::text, s.active, s.active_pid, "
            "pg_current_wal_lsn()::text, r.sent_lsn::text, extract(epoch FROM r.flush_lag)::float8 "
            "FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid "
            "WHERE s.slot_name = %s", [cfg.source["slot"]]).fetchone()
        if conn is not None:
            out["ddl_capture"] = capture.state(conn).detail
            if cfg.source["failover"]:
                refused = failover.refusal(cfg, conn.info.server_version)
                out["failover"] = ({"error": str(refused)} if refused is not None
                                   else failover.readiness(cfg, conn).as_dict())
        if row is None or conn is None:
            out["slot_exists"] = None if conn is None else False
        else:
            confirmed, restart, active, active_pid, current, sent, flush_lag = row
            applied = progress.lsn if progress.lsn else LSN.parse(confirmed or "0/0")
            out.update(applied_lsn=str(applied), slot_exists=True, slot_confirmed_lsn=confirmed,
                       slot_restart_lsn=restart, slot_active=active, slot_active_pid=active_pid)
            out.update(slothealth.read(conn, cfg.source["slot"]).as_dict())
            out["source_wal_lsn"] = current
            if active:  # streaming: the walsender knows what it sent and how late the confirmations are
                behind = sent is not None and LSN.parse(sent) > applied
                out["lag_bytes"] = max(0, LSN.parse(current) - applied) if behind else 0
                out["lag_seconds"] = round(flush_lag, 3) if behind and flush_lag is not None else 0.0
            else:
                pending = first_pending(cfg, conn, applied)
                out["lag_bytes"] = 0 if pending is None else max(0, LSN.parse(current) - applied)
                out["lag_seconds"] = (0.0 if pending is None else None if pending < 0
                                      else round(max(0.0, time.time() - pg_timestamp(pending).timestamp()), 3))
    out["last_applied_commit_time"] = (None if progress.commit_time is None
                                       else pg_timestamp(progress.commit_time).isoformat(timespec="seconds"))
    out["last_error"] = progress.last_error
    out["last_error_at"] = progress.last_error_at
    out["skip_lsn"] = None if progress.skip_lsn is None else str(progress.skip_lsn)
    out["prepared_waiting"] = list_prepared(cfg)
    out["recopy_needed"] = progress.recopy_needed
    out["source_timeline"] = progress.source_timeline
    out["resynced"] = None if progress.resynced_from is None else {"from": progress.resynced_from,
                                                                    "at": progress.resynced_at}
    out["repairs"] = repairs
    with target_db(cfg) as conn:
        out["conflicts"] = {str(k): int(n) for k, n in conn.execute(sql.count_conflicts,
                                                                     [cfg.apply["name"]]).fetchall()}
        ddl = conn.execute(sql.last_ddl, [cfg.apply["name"]]).fetchone()
        held = conn.execute(sql.held_tables, [cfg.apply["name"]]).fetchall()
    out["held"] = [{"table": f"{schema}.{table}", "transactions": int(n)} for _oid, schema, table, n in held]
    cols = ("lsn", "table", "class", "result", "change", "statement", "at")
    out["last_ddl"] = None if ddl is None else {k: None if v is None else str(v) for k, v in zip(cols, ddl)}
    return out


def conflicts(cfg: Config, prune: str | None = None, limit: int = 20) -> dict[str, Any]:
    """applier_conflicts of this apply.name (``applier conflicts``): counts by type, the ``limit`` newest rows,
    and with ``prune`` (an age such as 7d) the rows recorded before it deleted first ("pruned": how many)."""
    check_target(cfg)
    sql = _progress_sql(cfg)
    name = cfg.apply["name"]
    out: dict[str, Any] = {"name": name}
    with target_db(cfg) as conn:
        if prune is not None:
            out["pruned"] = prune_conflicts(conn, sql, name, parse_age(prune, "--prune"))
        out["counts"] = {str(k): int(n) for k, n in conn.execute(sql.count_conflicts, [name]).fetchall()}
        cols = ("recorded_at", "conflict_type", "table_name", "key", "resolution", "commit_lsn", "xid")
        out["latest"] = [dict(zip(cols, r)) for r in conn.execute(sql.latest_conflicts, [name, limit]).fetchall()]
    return out


PEEK_LIMITS = (1, 64, 4096)  # changes per peek: the first pending commit is usually in the first one


def first_pending(cfg: Config, conn: psycopg.Connection[Any], applied: LSN) -> int | None:
    """Commit time (µs since 2000) of the first published change not yet applied; None: nothing pending.

    Peeks the idle slot (never consumes it) with streaming on, so a large transaction arrives in
    chunks rather than whole, with growing limits. A transaction counts once it committed with a
    change in it (a large transaction that published nothing still streams empty chunks). -1:
    something may be pending but its commit was not within the limits (a long streamed
    transaction, or thousands of transactions the target applied but the slot was not told of
    yet), or the slot could not be peeked.
    """
    options = StreamOptions(tuple(cfg.source["publications"]), proto_version=2, streaming=True)
    flat = [v for pair in options.as_pairs(conn.info.server_version) for v in pair]
    sql = f"SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s{', %s' * len(flat)})"
    conn.execute("SET statement_timeout = '5s'")  # a long way from restart_lsn: better unknown than stuck
    for limit in PEEK_LIMITS:
        try:
            rows = conn.execute(sql, [cfg.source["slot"], limit, *flat]).fetchall()
        except psycopg.Error:  # taken by an applier meanwhile, too slow, or not peekable here
            return -1
        begin: Begin | None = None  # the plain transaction in hand
        streaming: int | None = None  # the xid of the stream block in hand
        changed: set[int] = set()  # streamed transactions with a change in them
        for (data,) in rows:
            kind = kind_of(data)
            if kind in ROW_CHANGES:
                if begin is not None and begin.final_lsn >= applied:
                    return begin.commit_time
                if streaming is not None:
                    changed.add(streaming)
            elif kind == MessageKind.COMMIT:
                begin = None
            elif kind in _DECODED:
                msg = decode_message(bytes(data))
                if isinstance(msg, Begin):
                    begin = msg
                elif isinstance(msg, StreamStart):
                    streaming = msg.xid
                elif isinstance(msg, StreamStop):
                    streaming = None
                elif isinstance(msg, StreamCommit) and msg.xid in changed and msg.commit_lsn >= applied:
                    return msg.commit_time
        if len(rows) < limit:  # the peek reached the end of the WAL: nothing committed is pending
            return None
    return -1


# the kinds first_pending decodes to follow the transaction or stream block in hand
_DECODED = frozenset((MessageKind.BEGIN, MessageKind.STREAM_START, MessageKind.STREAM_STOP, MessageKind.STREAM_COMMIT))


def list_prepared(cfg: Config) -> list[dict[str, str]]:
    """Prepared transactions applied up to PREPARE that wait for their COMMIT/ROLLBACK PREPARED."""
    target = opener.open(cfg, applying=False)
    try:
        out = [{"gid": r[0], "xid": str(r[1]), "prepare_lsn": r[2], "end_lsn": r[3], "kept_in": "applier_prepared"}
               for r in target.list_prepared()]
        if target.native_prepare:
            out += [{"gid": g, "kept_in": "pg_prepared_xacts"} for g in sorted(target.prepared_gids())]
        return out
    finally:
        target.close()
