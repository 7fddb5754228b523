"""``applier repair``: rewrite only the key ranges of replicated tables that differ from the source, joined to the
stream at a snapshot the way ``applier sync --table`` joins a copied table, while ``applier run`` keeps running.

``repair(cfg, tables)`` (every published table when none is named), per table T:

1. T's copy is *claimed* (``claim.copy_claim_name``, as ``sync --table`` claims it) for the whole command: a
   second repair or a ``sync --table`` of T is refused naming the holder, and an applier holding T's changes
   can tell a running repair from a dead one (``JoinGate.dead``);
2. T's ``applier_sync_tables`` row is set to 'repair' (durable; every table's row checked first, then all set in
   one transaction: a refusal leaves none held): the applier that applies to the target now is
   asked to hold T's changes. It answers between two transactions, about once a second (``JoinGate.repairs``,
   ``ApplyEngine.answer_repairs``): T's binding is dropped, so its next change reads the row and is held
   (``applier.engine.holding``), and the row is set to 'repairing' in the target transaction that commits
   everything applied to T before. An applier waiting for another table (a ``TableWait``: apply.new_tables
   "wait", a prepared transaction waiting for a copy) answers while it waits (``Runner._answer_repairs``), in a
   transaction of its own: exactly-once-safe, because a wait runs no session (everything applied is committed
   at the recorded position, nothing bound), so the next session binds T anew, reads 'repairing' and holds, as
   an applier started after the answer does. So the wait for an answer is bounded by the applier's poll. The command waits for that answer; when no applier holds the progress row
   (``claim``), it answers itself: an applier starting later reads the row when it binds T and holds; one running whose claim's connection was
   lost unbinds T at its next poll (``JoinGate.repairs`` reads 'repairing' rows too) and holds from then on.
   From the answer on, T on the target does not change but by this command;
3. a temporary logical slot with ``SNAPSHOT 'export'``: its consistent point S, recorded on the rows. Every
   change of T that the applier applied was committed before S (the slot is made after the answer); every later
   one, and every one committed between the answer and S, is held;
4. T compared with the source in snapshot S by verify's key-range hashes (1024 ranges of the key's hash): on the
   servers (``applier.migrate.spark.rangehash``) when the target is PostgreSQL with T's column types and the
   source's encoding; else in Spark (``applier.migrate.spark.verify``'s row hashes). The rows of the differing
   ranges are then read with their place (the source's ``ctid`` in S, the target's ``ctid``/``rowid``, with the
   partition's OID for a partitioned table), so that the rows to rewrite are found again by a TID scan, not a hash
   of every row (the source table's files, recorded before the comparison, are checked again under a lock at the
   rewrite: a VACUUM FULL or CLUSTER between moves its rows, and the table's repair then stops, to be run again);
5. each differing range rewritten whole in ONE target transaction (``rewrite_groups``: up to 64 ranges and about
   10,000 rows share one, as a commit per range would cost more than its rows): the range's rows that differ
   (``_counted``: a key on one side only, a row that differs, a key held twice) deleted from the target and copied
   from the source in S, the rows alike on both sides left as they are, and an ``applier_repairs`` row (migration
   0009: run, table, S, range, rows inserted / updated / deleted) written. A unique value that moved between rows
   of two groups (two rows swapped it) fails the first group's transaction: it is then rewritten with the next
   group, then with the next two, … in one transaction (all their old rows deleted before any is copied). T on the target is then the source at S
   exactly: what the applier applied before the answer plus drift (rows deleted, changed or added on the target by
   hand), and the changes held before S, are all differences of the comparison at S;
6. the row set to 'ready' (durable). The applier drains the held changes as after a copy: those committed before
   S skipped (they are in the repaired table), the later ones applied, in commit order; nothing lost or doubled.

Schema changes: a repair compares and rewrites the source's columns, so T's target table must have them: one
that lacks a source column (a schema change the applier has not applied yet) is refused before anything is held.
A column added, dropped or renamed on the source after the answer and before S is held with T's changes, and
being before S it would be skipped at the drain, the rewrite leaving the target table in its old shape: so T's
columns at S are checked against the target table's (a target column the source lacks counts only if it was not
there before the hold: ``_changed_shape``), and a T that changed is not rewritten but released (its row 'ready'
at 0/0: the applier applies all it held, the schema change among them, as if no repair had asked) and named in one
line (the other tables are repaired; exit 2); run the repair again once the applier applied it. A T a killed
repair held before this run stays held (ranges rewritten at that repair's snapshot hold its rows): the line says
to make the target table fit by hand first.

Why hold from the answer, not from S (applying T's changes committed before S first): the applier would need to
know S before it reaches it, and S can only be taken after it holds, or a change committed after S could be
applied before the applier knows S. Held changes before S cost a rewrite of the ranges they touched, nothing else.

A table without a key (no primary key, no replica identity index): its ranges are those of the whole row's hash,
as verify compares it; a row whose number of copies differs is rewritten with all its copies, so a range
rewritten holds the source's rows of that hash range, duplicates included.

``dry_run``: nothing is written, no row changes state, the control tables are not upgraded (read as they are, at
revision 0003 or later: no applier_repairs needed): a snapshot is taken and each table compared with the target as it is,
the differing ranges and counts reported. While an applier applies, the changes not yet applied
at that moment show up as differences too (the report says so).

A repair killed half-way: the ranges it rewrote are each whole (one transaction) and recorded; the row stays
'repair'/'repairing', the applier holds T's changes and says the repair is dead. Run again, it takes a new
snapshot S' and goes through the steps again: the ranges differing at S' (those the killed run did not reach,
and those changed since) are rewritten; the held changes before S' are skipped at the drain.

Refused, one line each (``RepairError``, exit 2; another run holding a claim: 5): a target that is no replica (as
``sync --table`` says), a two-phase config (a prepared transaction cannot be placed before or after S), a table
that is not published, whose target table is missing, or that a ``sync --table`` copies now (its row 'init' or
'copying'); another repair or copy of the table (the claim).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import reduce
from typing import Any

import psycopg

from applier.admin import check_source, check_target, source_connect, upgrade_control_tables
from applier.config import Config
from applier.engine.joingate import REPAIR_STATES
from applier.errors import InUseError
from applier.lsn import LSN
from applier.migrate.add_table import claim_copy, need_replica, published_tables, temporary_slot_name
from applier.migrate.schema import SourceTable
from applier.migrate.spark.pgread import pg_in_snapshot, pinned_dsn, range_query
from applier.migrate.spark.plans import pg_plan
from applier.migrate.spark.session import reraise_interrupt, spark_for
from applier.migrate.sync import SyncError, TargetDb, _now, read_tables_in_snapshot
from applier.source.base import SourceError
from applier.source.walsender import WalSender
from applier.targets.claim import Held
from applier.text import one_line, quote_ident

ANSWER_WAIT = 60.0  # seconds a repair waits for the running applier to hold a table before saying so again


class RepairError(SyncError):
    """A repair refused or failed: one line naming what and where."""


@dataclass
class RangeRepair:
    """One key range of a table that differs: the rows a rewrite inserts (keys only on the source), updates (keys on
    both sides, rows different) and deletes (keys only on the target)."""

    key_range: int
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    source_at: list[str] = field(default_factory=list, repr=False)  # the places of its differing rows (``_place``)
    target_at: list[str] = field(default_factory=list, repr=False)  # on the target (a SQLite target: rowids)

    @property
    def rows(self) -> int:
        """The rows its rewrite deletes and copies."""
        return len(self.source_at) + len(self.target_at)

    def as_json(self) -> dict[str, int]:
        """For --json (not the places)."""
        return {"key_range": self.key_range, "inserted": self.inserted, "updated": self.updated,
                "deleted": self.deleted}


@dataclass
class TableRepair:
    """What the repair of one table found and did."""

    table: str
    target: str
    keyed: bool
    source_rows: int = 0
    target_rows: int = 0
    ranges: list[RangeRepair] = field(default_factory=list)
    rewritten: bool = False  # the ranges were rewritten (not a dry run)
    source_files: str = ""  # the source table's files when it was compared (``source_files``)
    source_partitioned: bool = False  # read with its partitions: a place is (partition OID, ctid)
    target_partitioned: bool = False

    @property
    def counts(self) -> tuple[int, int, int]:
        """(inserted, updated, deleted) over the differing ranges."""
        return (sum(r.inserted for r in self.ranges), sum(r.updated for r in self.ranges),
                sum(r.deleted for r in self.ranges))


@dataclass
class RepairReport:
    """What ``repair`` found (and, unless a dry run, did)."""

    snapshot_lsn: str
    dry_run: bool
    tables: list[TableRepair] = field(default_factory=list)

    def lines(self) -> list[str]:
        """For people: a line per table, then a summary."""
        out = []
        for t in self.tables:
            ins, upd, dele = t.counts
            how = "" if t.keyed else " (no key: ranges of the whole row's hash)"
            if not t.ranges:
                out.append(f"{t.table}: OK, {t.source_rows:,} rows agree at {self.snapshot_lsn}{how}")
                continue
            verb = "would rewrite" if self.dry_run else "rewrote"
            shown = ", ".join(str(r.key_range) for r in t.ranges[:20]) + (" …" if len(t.ranges) > 20 else "")
            out.append(f"{t.table}: {verb} {len(t.ranges)} of 1024 key ranges ({shown}){how}: {ins:,} rows "
                       f"inserted, {upd:,} updated, {dele:,} deleted (source {t.source_rows:,} rows, target "
                       f"{t.target_rows:,} before)")
        differing = [t for t in self.tables if t.ranges]
        if self.dry_run:
            out.append(f"repair --dry-run: {len(differing)} of {len(self.tables)} tables differ at {self.snapshot_lsn}; "
                       f"nothing written (changes an applier had not applied yet count as differences)")
        else:
            out.append(f"repair: {len(differing)} of {len(self.tables)} tables repaired at {self.snapshot_lsn}; "
                       f"`applier run` applies their later changes")
        return out

    def as_json(self) -> dict[str, Any]:
        """For --json."""
        return {"snapshot_lsn": self.snapshot_lsn, "dry_run": self.dry_run,
                "tables": [{**asdict(t), "ranges": [r.as_json() for r in t.ranges],
                            "counts": dict(zip(("inserted", "updated", "deleted"), t.counts, strict=True))}
                           for t in self.tables]}


def repair(cfg: Config, tables: list[str] | None = None, *, dry_run: bool = False, spark: Any = None,
           say: Callable[[str], None] | None = None) -> RepairReport:
    """Repair the named published tables ("schema.table"; every published one when None); see the module header."""
    say = say or (lambda line: None)
    try:
        return _repair(cfg, tables, dry_run, spark, say)
    except (psycopg.Error, sqlite3.Error) as exc:
        raise RepairError(f"`applier repair` failed: {one_line(exc)}") from None


def _repair(cfg: Config, names: list[str] | None, dry_run: bool, spark: Any,
            say: Callable[[str], None]) -> RepairReport:
    name = cfg.apply["name"]
    if cfg.source["two_phase"] and not dry_run:
        raise RepairError(f"{cfg.where('source', 'two_phase')}: `applier repair` cannot join a repaired table to a "
                          f"two-phase stream: a prepared transaction is applied before its commit LSN is known, so it "
                          f"cannot be placed before or after the repair's snapshot")
    check_source(cfg)
    revision = check_target(cfg, need_init=False)
    if not dry_run and (line := upgrade_control_tables(cfg, revision)):
        say(line)
    target = TargetDb(cfg)
    claims: list[Held | None] = []
    held_before: set[str] = set()
    run = uuid.uuid4().hex
    try:
        need_replica(target, name, "applier repair")
        tables = published_tables(cfg, names) if names else read_tables_in_snapshot(cfg, None)
        extra: dict[str, set[str]] = {}  # each target table's columns of its own (no source column's), before
        for t in tables:
            if not target.exists(t):
                raise RepairError(f"target table {target.name_of(t)[0]} of source table {t.qualified} does not exist: "
                                  f"nothing to repair; `applier sync --table {t.qualified}` copies it")
            missing, extra[t.qualified] = _shapes(target, t)
            if missing:
                raise RepairError(f"target table {target.name_of(t)[0]} lacks column(s) {', '.join(missing)} of "
                                  f"source table {t.qualified}: a schema change `applier run` has not applied yet "
                                  f"(it does at the table's next change), or columns dropped on the target; nothing "
                                  f"repaired: run `applier repair` again once the target table has them")
        if not dry_run:
            claims = [claim_table(target, name, t) for t in tables]
            held_before = _ask_to_hold(target, name, tables, run)
            _wait_for_answers(target, name, tables, run, say)
        with _snapshot(cfg, run) as (snapshot, at):
            report = RepairReport(str(at), dry_run)
            if not dry_run:
                _set_rows(target, name, run, tables, f"snapshot_lsn = {target.ph}", [str(at)])
            say(f"source snapshot at {at}")
            if spark is None:
                spark = spark_for(cfg)
            in_snapshot = {t.qualified: t for t in read_tables_in_snapshot(cfg, snapshot)}
            refused: list[str] = []  # tables whose shape changed in the window (``_changed_shape``)
            for t in tables:
                now = in_snapshot.get(t.qualified)
                if now is None:
                    raise RepairError(f"source table {t.qualified} is no longer published at the repair's snapshot")
                if changed := _changed_shape(target, now, extra[t.qualified], t, str(at)):
                    refused.append(changed + _released(target, name, run, t, dry_run, held_before))
                    continue
                say(f"comparing {t.qualified}")
                found = compare_table(cfg, target, spark, now, snapshot)
                if not dry_run and found.ranges:
                    rewrite_ranges(cfg, target, now, found, snapshot, str(at), run, say)
                    found.rewritten = True
                if not dry_run:
                    # the server's clock: finished_at bounds the rewrite's commits as not foreign (``_copied_at``)
                    _set_rows(target, name, run, [t], "state = 'ready', finished_at = CURRENT_TIMESTAMP", [])
                report.tables.append(found)
        if refused:  # the other tables are repaired
            raise RepairError("; ".join(refused))
        return report
    finally:
        target.close()
        for claim in claims:
            if claim is not None:
                claim.release()


def _shapes(target: TargetDb, t: SourceTable) -> tuple[list[str], set[str]]:
    """(the source columns of ``t`` that its target table lacks, the target table's columns the source does not
    have): a repair compares and rewrites the source's columns, so the first must be empty."""
    held = target.column_names(t)
    source = {c.name for c in [*t.columns, *t.generated]} | set(t.unpublished)
    return [c.name for c in t.columns if c.name not in held], held - source


def _columns_of(t: SourceTable) -> dict[str, tuple[int, int, bool]]:
    """Each source column's (type, type modifier, NOT NULL): what a schema change of a column alters."""
    return {c.name: (c.type_oid, c.type_mod, c.not_null) for c in [*t.columns, *t.generated]}


def _changed_shape(target: TargetDb, t: SourceTable, extra_before: set[str], before: SourceTable,
                   at: str) -> str | None:
    """Why ``t`` (its columns at the repair's snapshot ``at``) cannot be repaired: a column added, renamed, dropped
    or altered (its type, NOT NULL) on the source after the applier held the table's changes and before the
    snapshot (``before``: the table as read before the hold). That change is held with them and, being before the
    snapshot, would be skipped at the drain (the rewrite does not change the target table's shape), so the table
    would stay in its old shape: refused instead. None: the shapes fit."""
    missing, extra = _shapes(target, t)
    dropped = sorted(extra - extra_before)
    was, now = _columns_of(before), _columns_of(t)
    altered = sorted(c for c in now.keys() & was.keys() if now[c] != was[c])
    if not missing and not dropped and not altered:
        return None
    what = "; ".join(([f"column(s) {', '.join(missing)} added or renamed"] if missing else [])
                     + ([f"column(s) {', '.join(dropped)} dropped or renamed"] if dropped else [])
                     + ([f"column(s) {', '.join(altered)} altered"] if altered else []))
    return (f"source table {t.qualified} changed shape at the repair's snapshot {at} ({what} on the source) and "
            f"target table {target.name_of(t)[0]} does not have that shape yet")


def _released(target: TargetDb, name: str, run: str, t: SourceTable, dry_run: bool, held_before: set[str]) -> str:
    """Stop holding ``t`` without repairing it (its shape changed: ``_changed_shape``); the rest of the line. The
    row 'ready' at 0/0: the applier applies every change it held (all after its answer, the schema change among
    them) and the later ones, as if no repair had asked. Not when a killed repair held it before this run (the
    ranges it rewrote hold its snapshot's rows: the held changes before it must be skipped): it stays held."""
    if dry_run:
        return " (a dry run: nothing held, nothing written)"
    if t.qualified in held_before:
        return (f"; nothing rewritten in it by this run, and it stays held (an earlier repair of it did not end): "
                f"make target table {target.name_of(t)[0]} fit the source table's columns by hand (ALTER TABLE), "
                f"then run `applier repair --table {t.qualified}` again")
    _set_rows(target, name, run, [t], "state = 'ready', snapshot_lsn = '0/0', finished_at = CURRENT_TIMESTAMP", [])
    return (f"; nothing rewritten in it: `applier run` now applies its held changes, that schema change among "
            f"them; run `applier repair --table {t.qualified}` again once it has")


def claim_table(target: TargetDb, name: str, t: SourceTable) -> Held | None:
    """Claim ``t``'s copy (``copy_claim_name``) for this repair; RepairError naming the holder if taken."""
    return claim_copy(target, name, t, "repair", lambda holder: InUseError(
        f"source table {t.qualified} is being repaired or copied to this target for apply.name {name!r}: {holder}; "
        f"let it end (or stop it) first"))


def _ask_to_hold(target: TargetDb, name: str, tables: list[SourceTable], run: str) -> set[str]:
    """Step 2: the tables' rows to 'repair' in one durable transaction, once every row is checked: RepairError, and
    no row changed, while a ``sync --table`` copies one of them. The tables held already (by a repair that did not
    end)."""
    ph = target.ph
    writes: list[tuple[str, list[Any]]] = []
    held: set[str] = set()
    for t in tables:
        key = [name, t.schema, t.name]
        row = target.execute(f"SELECT state FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} "
                             f"AND table_name = {ph}", key)
        if row and row[0][0] not in ("ready", *REPAIR_STATES):
            raise RepairError(f"source table {t.qualified} is being copied by `applier sync --table` ({row[0][0]}, "
                              f"interrupted: its claim is free): run `applier sync --table {t.qualified}` to finish "
                              f"it")
        if row and row[0][0] in REPAIR_STATES:
            held.add(t.qualified)
        writes += [
            (f"DELETE FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} AND table_name = {ph}", key),
            (f"INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run, started_at) "
             f"VALUES ({ph}, {ph}, {ph}, 'repair', {ph}, {ph})", [*key, run, _now()]),
        ]
    target.transaction(writes, durable=True)
    return held


def _wait_for_answers(target: TargetDb, name: str, tables: list[SourceTable], run: str,
                      say: Callable[[str], None]) -> None:
    """Until the applier that applies to the target holds every table (rows 'repairing'); none: answered here."""
    ph = target.ph
    said = time.monotonic()
    while True:
        holder = target.holder(name)
        if holder is None:  # nobody applies: one that starts reads the rows when it binds the tables, and holds
            _set_rows(target, name, run, tables, "state = 'repairing'", [])
            return
        states = target.execute(f"SELECT state FROM applier_sync_tables WHERE name = {ph} AND run = {ph}", [name, run])
        if len(states) != len(tables):
            raise _taken_over(tables, name)
        if all(s == "repairing" for (s,) in states):
            return
        if time.monotonic() - said > ANSWER_WAIT:
            said = time.monotonic()
            say(f"waiting for {holder} to hold the changes of "
                f"{', '.join(t.qualified for t, (s,) in zip(tables, states, strict=True) if s != 'repairing')} "
                f"(it answers between two transactions and while it waits for a table; a transaction waiting for a lock on "
                f"the target, or retried after an error, delays it)")
        time.sleep(0.2)


def _set_rows(target: TargetDb, name: str, run: str, tables: list[SourceTable], assign: str, params: list[Any]) -> None:
    """``assign`` on this run's rows of ``tables`` (durable); RepairError if one is no longer this run's."""
    ph = target.ph
    for t in tables:
        changed = target.transaction([(f"UPDATE applier_sync_tables SET {assign} WHERE name = {ph} AND run = {ph} "
                                       f"AND schema_name = {ph} AND table_name = {ph}",
                                       [*params, name, run, t.schema, t.name])], durable=True)
        if changed[0] != 1:
            raise _taken_over([t], name)


def _taken_over(tables: list[SourceTable], name: str) -> RepairError:
    return RepairError(f"another `applier sync` took over {', '.join(t.qualified for t in tables)} for apply.name "
                       f"{name!r} (its applier_sync_tables row is no longer this repair's): this repair stops")


@contextmanager
def _snapshot(cfg: Config, run: str) -> Iterator[tuple[str, LSN]]:
    """Step 3: (exported snapshot, consistent point) of a temporary slot, alive until the block ends."""
    try:
        ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
    except SourceError as exc:
        raise RepairError(f"{cfg.where('source', 'dsn')}: {exc}") from None
    try:
        slot = temporary_slot_name(cfg.apply["name"], run).replace("applier_add_", "applier_repair_", 1)
        try:
            info = ws.create_slot(slot, snapshot="export", temporary=True)
        except SourceError as exc:
            raise RepairError(f"{cfg.where('source', 'dsn')}: cannot create the temporary slot {slot!r}: "
                              f"{exc}") from None
        assert info.snapshot_name is not None  # asked for (SNAPSHOT 'export')
        yield info.snapshot_name, info.consistent_point
    finally:
        ws.close()  # the temporary slot goes with it


# -- step 4: the differing ranges --------------------------------------------------------------

def _columns(target: TargetDb, t: SourceTable) -> tuple[list[str], list[str]]:
    """(compared columns, those compared as NULL), as verify compares them."""
    held = target.column_names(t)
    compared = [c.name for c in t.columns] + [c.name for c in t.generated if c.name in held]
    nulls = [c for c in target.columns_without_default(t) if c in t.unpublished]
    return compared, nulls


def compare_table(cfg: Config, target: TargetDb, spark: Any, t: SourceTable, snapshot: str) -> TableRepair:
    """The differing key ranges of ``t`` and their counts (see the module header); a failed Spark job: RepairError
    naming the table, in one line (as verify reports it)."""
    # start-up time: these load pyspark
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    from applier.migrate.spark.copy import spark_error_line

    with source_connect(cfg) as conn:
        files = source_files(conn, t)
    try:
        found = _compare_table(cfg, target, spark, t, snapshot)
        found.source_files = files
        return found
    except (PySparkException, Py4JError) as exc:
        reraise_interrupt(exc)
        raise RepairError(f"comparing source table {t.qualified} with target table {target.name_of(t)[0]} failed: "
                          f"{spark_error_line(exc)}") from None


def source_files(conn: Any, t: SourceTable) -> str:
    """The files of source table ``t`` (with its partitions when it is read with them): a row's place (ctid) found
    by the comparison holds the same row at the rewrite only if no VACUUM FULL, CLUSTER or table rewrite came
    between (each gives the table a new file; an old snapshot then sees its rows at other places)."""
    tree = "pg_partition_tree(%s::regclass)" if not t.only else "(SELECT %s::regclass AS relid) AS r"
    row = conn.execute(f"SELECT string_agg(relid::oid::text || ':' || pg_relation_filenode(relid)::text, ',' "
                       f"ORDER BY relid::oid) FROM {tree}", [t.qname]).fetchone()
    return str(row[0]) if row else ""


def _compare_table(cfg: Config, target: TargetDb, spark: Any, t: SourceTable, snapshot: str) -> TableRepair:
    # start-up time: these load pyspark
    from applier.migrate.spark.rangehash import same_types, server_encoding, target_types

    shown, qtarget = target.name_of(t)
    cols, nulls = _columns(target, t)
    compared = [c for c in t.columns] + [c for c in t.generated if c.name in cols]
    qcols = [quote_ident(c) for c in cols]
    mapped = not target.backend.keeps_types
    on_servers = False
    if not mapped:
        with source_connect(cfg) as conn:
            on_servers = server_encoding(conn) == server_encoding(target.conn) and same_types(
                [(c.name, c.type_schema, c.type_name, c.type_mod) for c in compared],
                target_types(target.conn, qtarget))
    src_plan = json.loads(pg_plan(cfg.source["dsn"], t.qname, qcols + ["NULL"] * len(nulls), pages=t.pages,
                                  partitions=cfg.spark["partitions"], snapshot=snapshot, where=t.rowfilter,
                                  app="applier-repair source", only=t.only,
                                  canonical_types=[c.type_oid for c in compared] + [25] * len(nulls)
                                  if mapped else None))
    _fmt, tgt_json = target.backend.read_plan(target.conn, target.where, qtarget,
                                              qcols + [quote_ident(c) for c in nulls], cfg.spark["partitions"])
    tgt_plan = json.loads(tgt_json)
    key = [quote_ident(k) for k in t.key_columns]
    res = TableRepair(t.qualified, shown, bool(key), source_partitioned=not src_plan.get("only", True),
                      target_partitioned=not tgt_plan.get("only", True))
    if on_servers:
        _compare_on_servers(spark, src_plan, tgt_plan, key, res)
    else:
        _compare_in_spark(spark, src_plan, tgt_plan, _fmt, len(cols) + len(nulls),
                          [cols.index(k) for k in t.key_columns], res)
    return res


log = logging.getLogger("applier.repair")

READ_ROWS = 100_000  # the rows of the differing parts read, at most, before parts are split further
PART_ROWS = 16  # rows a part should hold, about, once split (fewer: more sums than rows to read)
MIN_SPLIT_BITS = 4  # a split into fewer than 16 parts each is not worth its scan
MAX_BITS = 50
MAX_PARTS = 10_000  # the differing parts named in one filter, at most (more: the damage is most of the table)


def split_bits(rows: int, parts: int) -> int:
    """How many more bits of the key's md5 to split ``parts`` differing parts holding ``rows`` rows (both sides)
    by, so that each new part holds about ``PART_ROWS`` (0: not worth it: few rows, or parts already small)."""
    if rows <= READ_ROWS or parts > MAX_PARTS:
        return 0
    extra = int(math.log2(max(1.0, rows / (2 * parts * PART_ROWS))))
    return min(extra, 10) if extra >= MIN_SPLIT_BITS else 0


def split(table: str, counts: dict[int, int], bits: int,
          parts_of: Callable[[list[int], int, int], dict[int, int]]) -> tuple[list[int], int]:
    """The differing key ranges (``counts``: range -> rows on both sides, ranges of ``bits`` bits) split while
    ``split_bits`` says so: ``parts_of(parts, bits, finer)`` gives the differing parts of ``finer`` bits within
    ``parts`` and their rows. (The differing parts, their bits.)"""
    while extra := split_bits(sum(counts.values()), len(counts)):
        finer = min(MAX_BITS, bits + extra)
        if finer == bits:
            break
        log.debug("%s: %d differing parts of %d bits split into parts of %d bits", table, len(counts), bits, finer)
        counts, bits = parts_of(sorted(counts), bits, finer), finer
    return sorted(counts), bits


def _compare_on_servers(spark: Any, src_plan: dict[str, Any], tgt_plan: dict[str, Any], key: list[str],
                        res: TableRepair) -> None:
    """PostgreSQL on both sides, same types: the ranges' sums on the servers; while the differing ones hold more
    than ``READ_ROWS`` rows, the sums of their parts (``split_bits``: the next bits of the key's md5, parts of
    about ``PART_ROWS`` rows), so that few rows alike on both sides are read; then the differing parts' row hashes
    (key text and row text md5s) read to count."""
    from applier.migrate.spark.rangehash import (  # start-up time: pyspark
        KEY_BITS,
        Sums,
        bucket_filter,
        bucket_of,
        hash_plan,
        range_sums,
        row_text,
    )

    plans = [src_plan, tgt_plan]
    a, b = range_sums(spark, *[hash_plan(p, p["columns"], key) for p in plans])
    res.source_rows, res.target_rows = sum(v[0] for v in a.values()), sum(v[0] for v in b.values())
    differing = sorted(r for r in a.keys() | b.keys() if a.get(r) != b.get(r))
    if not differing:
        return
    def narrowed(p: dict[str, Any], parts: list[int], bits: int) -> dict[str, Any]:
        where = bucket_filter(key or p["columns"], parts, bits)
        return {**p, "where": f"({p['where']}) AND {where}" if p.get("where") else where}

    def differing_parts(a: dict[int, Sums], b: dict[int, Sums]) -> dict[int, int]:
        return {r: a.get(r, (0,))[0] + b.get(r, (0,))[0] for r in a.keys() | b.keys() if a.get(r) != b.get(r)}

    def parts_of(parts: list[int], bits: int, finer: int) -> dict[int, int]:
        return differing_parts(*range_sums(spark, *[hash_plan(narrowed(p, parts, bits), p["columns"], key, finer)
                                                    for p in plans]))

    ranges = differing
    differing, bits = split(res.table, differing_parts(a, b), KEY_BITS, parts_of)
    hashed: list[dict[int, list[tuple[str, str, str]]]] = []
    for p in plans:
        keyed = key or p["columns"]
        read = {**narrowed(p, differing, bits), "columns": [bucket_of(keyed), f"md5({row_text(keyed)})",
                                                           f"md5({row_text(p['columns'])})", _place(p)]}
        side: dict[int, list[tuple[str, str, str]]] = {}
        with pg_in_snapshot(read, 0) as conn:
            for bucket, k, r, at in conn.execute(range_query(read, None, None)):
                side.setdefault(int(bucket), []).append((k, r, at))
        hashed.append(side)
    for r in ranges:
        res.ranges.append(_counted(r, hashed[0].get(r, []), hashed[1].get(r, []), bool(key)))


def _place(plan: dict[str, Any]) -> str:
    """SQL for a row's place in a PostgreSQL table of a plan, found again by ``_where_places``: its ctid (stable in the
    source's snapshot, and on the target, where nothing but the repair writes the table now); with its table's OID
    when the plan reads a partitioned table (each partition has its own ctids)."""
    return "ctid::text" if plan.get("only", True) else "tableoid::text || ' ' || ctid::text"


def _where_places(places: list[str], partitioned: bool) -> str:
    """A condition selecting the rows at these places (``_place``) of a PostgreSQL table (a TID scan), read with its
    partitions or not: one ctid array per partition (an IN list of (oid, ctid) pairs is an OR tree, too deep past
    a few thousand)."""
    if not places:
        return "false"
    if not partitioned:
        return _tids(places)
    by: dict[int, list[str]] = {}
    for p in places:
        oid, tid = p.split(" ", 1)
        by.setdefault(int(oid), []).append(tid)
    return " OR ".join(f"(tableoid = {oid}::oid AND {_tids(tids)})" for oid, tids in sorted(by.items()))


def _tids(tids: list[str]) -> str:
    return "ctid = ANY('{" + ",".join(f'"{c}"' for c in tids) + "}'::tid[])"


def _counted(bucket: int, src: list[tuple[Any, Any, str]], tgt: list[tuple[Any, Any, str]],
             keyed: bool) -> RangeRepair:
    """The counts of one range from both sides' (key hash, row hash, place) triples, and the places of the rows
    that differ on each side (the rows a rewrite deletes from the target and copies from the source: a key on one
    side only, a row that differs, a key held twice; without a key the row is the key, and a row whose number of
    copies differs is rewritten with all its copies). The rows alike on both sides are left as they are."""
    fix = RangeRepair(bucket)
    if keyed:
        s, t = {k: h for k, h, _ in src}, {k: h for k, h, _ in tgt}
        fix.inserted = sum(1 for k in s if k not in t)
        fix.deleted = sum(1 for k in t if k not in s)
        fix.updated = sum(1 for k in s if k in t and s[k] != t[k])
        held = Counter(k for k, _, _ in tgt)
        twice = {k for k, n in (Counter(k for k, _, _ in src) + held).items() if n > (k in s) + (k in t)}
        fix.deleted += sum(held[k] - 1 for k in twice if held[k] > 1)  # a key's other copies on the target
        differs = {k for k in s.keys() | t.keys() if s.get(k) != t.get(k)} | twice
    else:
        cs, ct = Counter(k for k, _, _ in src), Counter(k for k, _, _ in tgt)
        fix.inserted = sum((cs - ct).values())
        fix.deleted = sum((ct - cs).values())
        differs = {k for k in cs.keys() | ct.keys() if cs[k] != ct[k]}
    fix.source_at = [at for k, _, at in src if k in differs]
    fix.target_at = [at for k, _, at in tgt if k in differs]
    return fix


def _compare_in_spark(spark: Any, src_plan: dict[str, Any], tgt_plan: dict[str, Any], fmt: str, ncols: int,
                      key_idx: list[int], res: TableRepair) -> None:
    """Any target: verify's row hashes in Spark, each row with its place (source ctid, target rowid or ctid); the
    differing ranges split into parts while they hold many rows (as ``_compare_on_servers``)."""
    from pyspark.sql import functions as F

    from applier.migrate.spark.source import read_table  # start-up time: pyspark, pyarrow
    from applier.migrate.spark.verify import KEY_BITS, SUMS, hash_sums, prepared  # start-up time: pyspark

    located = []
    for p, where in ((src_plan, _place(src_plan)), (tgt_plan, "rowid" if fmt == "applier_sqlite" else _place(tgt_plan))):
        plan = {**p, "columns": [*p["columns"], where]}
        if plan.get("canonical") is not None:
            plan["canonical"] = [*plan["canonical"], 25]
        located.append(prepared(read_table(spark, "applier_pg" if p is src_plan else fmt, json.dumps(plan)), ncols,
                                key_idx, keep=(f"c{ncols}",)))
    sides = [df.groupBy("bucket").agg(*hash_sums(F)) for df in located]
    sums = [{int(r["bucket"]): (r["n"], r["s1"], r["s2"], r["s3"]) for r in side.collect()} for side in sides]
    res.source_rows = sum(v[0] for v in sums[0].values())
    res.target_rows = sum(v[0] for v in sums[1].values())
    differing = sorted(r for r in sums[0].keys() | sums[1].keys() if sums[0].get(r) != sums[1].get(r))
    if not differing:
        return
    # the differing ranges split into parts (as on the servers) while they hold many rows; the parts' sums are
    # joined in Spark, only the differing parts (and their row counts) come to the driver
    def within(parts: list[int], bits: int) -> Any:
        return (F.col("bucket") if bits == KEY_BITS
                else F.shiftrightunsigned(F.xxhash64("key"), 64 - bits)).isin(parts)

    def parts_of(parts: list[int], bits: int, finer: int) -> dict[int, int]:
        part = F.shiftrightunsigned(F.xxhash64("key"), 64 - finer).alias("p")
        a, b = [df.where(within(parts, bits)).groupBy(part).agg(*hash_sums(F)).select(
            "p", *[F.col(c).alias(f"{x}{c}") for c in SUMS]) for df, x in zip(located, "ab", strict=True)]
        same = reduce(lambda u, v: u & v, [F.col(f"a{c}").eqNullSafe(F.col(f"b{c}")) for c in SUMS])
        return {int(r["p"]): (r["an"] or 0) + (r["bn"] or 0)
                for r in a.join(b, "p", "full_outer").where(~same).select("p", "an", "bn").collect()}

    parts, bits = split(res.table, {r: sums[0].get(r, (0,))[0] + sums[1].get(r, (0,))[0] for r in differing},
                        KEY_BITS, parts_of)
    rows = [df.where(within(parts, bits)).select("bucket", "key", "h", "m", f"c{ncols}").collect()
            for df in located]
    by: list[dict[int, list[tuple[Any, ...]]]] = [{}, {}]
    for side, got in enumerate(rows):
        for r in got:
            by[side].setdefault(int(r["bucket"]), []).append((tuple(bytes(x) for x in r["key"]), (r["h"], r["m"]),
                                                               r[f"c{ncols}"]))
    sqlite_target = fmt == "applier_sqlite"
    for b in differing:
        res.ranges.append(_counted(b, [(k, h, _loc(x, sqlite_target)) for k, h, x in by[0].get(b, [])],
                                   [(k, h, _loc(x, sqlite_target)) for k, h, x in by[1].get(b, [])], bool(key_idx)))


def _loc(v: Any, canonical: bool) -> str:
    """A row's place as the Spark source read it: the text (a ctid, a rowid), after its type tag if canonical."""
    text = bytes(v).decode()
    return text[1:] if canonical else text


# -- step 5: the rewrite -----------------------------------------------------------------------

RECORD = ("INSERT INTO applier_repairs (name, run, schema_name, table_name, snapshot_lsn, key_range, rows_inserted, "
          "rows_updated, rows_deleted, repaired_at) VALUES ({})")


REWRITE_RANGES = 64  # at most this many key ranges rewritten in one target transaction
REWRITE_ROWS = 10_000  # and (but for a single range) at most about this many rows


def rewrite_groups(ranges: list[RangeRepair]) -> Iterator[list[RangeRepair]]:
    """The differing ranges in groups, each group rewritten in one target transaction: a range is always whole in
    one, and a transaction per range would cost a commit (a flush) per range, more than its rows."""
    group: list[RangeRepair] = []
    rows = 0
    for fix in ranges:
        n = fix.rows
        if group and (len(group) >= REWRITE_RANGES or rows + n > REWRITE_ROWS):
            yield group
            group, rows = [], 0
        group.append(fix)
        rows += n
    if group:
        yield group


def rewrite_ranges(cfg: Config, target: TargetDb, t: SourceTable, found: TableRepair, snapshot: str, at: str, run: str,
             say: Callable[[str], None]) -> None:
    """The differing ranges in target transactions of a few ranges each (``rewrite_groups``): their target rows
    deleted, the source's rows in the snapshot inserted, each range recorded in applier_repairs."""
    # start-up time: these load pyspark / pyarrow
    from applier.migrate.spark.sqlitecopy import sqlite_rows

    shown, qtarget = target.name_of(t)
    cols = [quote_ident(c.name) for c in t.columns]
    plan = json.loads(pg_plan(cfg.source["dsn"], t.qname, cols, pages=t.pages, partitions=1, snapshot=snapshot,
                              where=t.rowfilter, app="applier-repair source", only=t.only))
    delete = f"DELETE FROM {target.own(t)} WHERE "
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(pg_in_snapshot(plan, 0))
        # the places found by the comparison hold until the rewrite ends: no VACUUM FULL or CLUSTER meanwhile
        src.execute(f"LOCK TABLE {'ONLY ' if t.only else ''}{t.qname} IN ACCESS SHARE MODE")
        if source_files(src, t) != found.source_files:
            raise RepairError(f"source table {t.qualified} was rewritten (VACUUM FULL, CLUSTER, ALTER TABLE) "
                              f"while it was compared: its rows are at other places now; run `applier repair` "
                              f"again")
        dst = None
        if target.backend.keeps_types:  # COPY text from the source into the target, both with the pinned settings
            dst = stack.enter_context(psycopg.connect(pinned_dsn(target.where, "applier-repair"), autocommit=True))
            with contextlib.suppress(psycopg.Error):  # as the copy: no triggers, no foreign-key checks, if the role may
                dst.execute("SET session_replication_role = replica")
        def rewrite(group: list[RangeRepair]) -> None:
            source_where = _where_places([at for fix in group for at in fix.source_at], found.source_partitioned)
            places = [at for fix in group for at in fix.target_at]
            if dst is not None:
                target_where = _where_places(places, found.target_partitioned)
            else:  # a SQLite target: rowids
                target_where = f"rowid IN ({', '.join(str(int(at)) for at in places)})" if places else "false"
            query = range_query({**plan, "where": f"({plan['where']}) AND ({source_where})" if plan.get("where")
                                 else source_where}, None, None)
            records = [[cfg.apply["name"], run, t.schema, t.name, at, fix.key_range, fix.inserted, fix.updated,
                        fix.deleted, _now()] for fix in group]
            if dst is not None:
                with dst.transaction():
                    dst.execute(delete + target_where)
                    with src.cursor().copy(f"COPY ({query}) TO STDOUT") as cin, \
                            dst.cursor().copy(f"COPY {qtarget} ({', '.join(cols)}) FROM STDIN") as cout:
                        for data in cin:
                            cout.write(data)
                    dst.cursor().executemany(RECORD.format(", ".join(["%s"] * 10)), records)
            else:
                insert = f"INSERT INTO {qtarget} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
                rows = sqlite_rows(src, query, [c.type_oid for c in t.columns])
                record = RECORD.format(", ".join("?" * 10))
                target.transaction([(delete + target_where, []), *[(insert, list(r)) for r in rows],
                                    *[(record, r) for r in records]])

        groups, first, span = list(rewrite_groups(found.ranges)), 0, 1
        while first < len(groups):
            try:
                rewrite([fix for group in groups[first:first + span] for fix in group])
            except Exception as exc:
                # a value of a unique column that moved to a row of a range rewritten later (two rows swapped it):
                # this group with the next one, then the next two, … in one transaction, all their old rows deleted
                # before any is copied
                if first + span >= len(groups) or not target.backend.failures.is_unique(exc):
                    raise
                span *= 2
                continue
            first, span = first + span, 1
    say(f"{t.qualified}: {len(found.ranges)} key ranges rewritten in target table {shown}")
