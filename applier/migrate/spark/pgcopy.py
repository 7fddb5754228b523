"""The task side of the copy into a PostgreSQL target: a Spark task's groups of partitions streamed from the
source's COPY into the target's, each group in one target transaction with its partitions' records.

What travels to the task (``CopyPlan``, pickled) and comes back (``PartDone``), the records of finished partitions
(``parts_sql``, ``applier_sync_parts``) and the check that a run is still the copy under way (``check_run``) are
here too: the driver (``applier.migrate.spark.copy``, ``applier.migrate.sync``) and the SQLite writer share them.
How the partitions are planned, grouped and scheduled, and why: ``applier.migrate.spark.copy``.

Imports neither pyspark nor pyarrow: the Python worker of a copy task unpickles ``copy_pg_partitions`` from this
module, and loads psycopg and a few small modules of applier's (``pgread``, ``applier.source.session``,
``applier.url``) only (bench/README.md, sync: the first job's Python worker).
"""

from __future__ import annotations

import select
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq

from applier.errors import ApplyError
from applier.migrate.spark.pgread import pg_in_snapshot, pinned_dsn, range_query
from applier.url import Kind

COPY_CHUNK = 1 << 20  # bytes of COPY data handed to the PostgreSQL target at a time


class CopyError(ApplyError):
    """A table could not be copied; the message names the table and the cause."""


def parts_sql(ph: str) -> tuple[str, str, str]:
    """(is the partition done?, record it, list a table's parts) for a parameter style."""
    return (f"SELECT 1 FROM applier_sync_parts WHERE name = {ph} AND run = {ph} AND tbl = {ph} AND part = {ph}",
            f"INSERT INTO applier_sync_parts (name, run, tbl, part, rows, bytes) VALUES ({ph}, {ph}, {ph}, {ph}, {ph}, {ph})",
            f"SELECT part, rows, bytes FROM applier_sync_parts WHERE name = {ph} AND run = {ph} AND tbl = {ph}")


@dataclass
class CopyPlan:
    """Everything the copy of a table's partitions needs (it travels to the Spark tasks, pickled)."""

    source: dict[str, Any]  # applier.migrate.spark.source.pg_plan, parsed: dsn, table, columns, ranges, snapshot …
    kind: Kind  # the target's
    target: str  # libpq DSN, or the SQLite file
    table: str  # quoted target table
    columns: list[str]  # quoted target columns, in the source's order
    types: list[int]  # the columns' source type OIDs
    name: str  # apply.name
    run: str  # the sync run
    tbl: str  # the source table, schema.name (key of applier_sync_parts)
    binary: bool = False  # PostgreSQL: COPY in binary format (see binary_safe)
    # sync --table: the source table's (schema, name), whose applier_sync_tables row names the run; None: a full
    # sync, whose applier_sync row does (check_run)
    joining: tuple[str, str] | None = None
    # what a ctid range's pages weigh: the whole table's pages (every leaf, TOAST included) per heap page the
    # ranges are cut from (``SourceTable.size_pages / pages``, at least 1), for ``task_groups``
    weight: float = 1.0

    @property
    def partitions(self) -> int:
        """How many partitions the table has."""
        return len(self.source["ranges"])


@dataclass
class PartDone:
    """What one partition wrote (``skipped``: it had been written before)."""

    part: int
    rows: int
    nbytes: int
    skipped: bool


def copy_pg_partitions(plan: CopyPlan, groups: list[list[int]]) -> list[PartDone]:
    """Copy ``groups`` of partitions from the source straight into a PostgreSQL target, one group after the other (a
    Spark task's work; see the module header): one connection to each end, the source's inside the snapshot
    throughout, each group of consecutive partitions in one source COPY and one target transaction together with its
    partitions' records (``_copy_pg_group``)."""
    if not groups:
        return []
    with psycopg.connect(pinned_dsn(plan.target, f"{plan.source['app']} write"), autocommit=True) as dst, \
            pg_in_snapshot(plan.source, groups[0][0]) as src:
        dst.execute("SET synchronous_commit = off")
        try:
            dst.execute("SET session_replication_role = replica")
        except psycopg.Error:
            pass
        return [done for group in groups for done in _copy_pg_group(plan, group, src, dst)]


def _copy_pg_group(plan: CopyPlan, group: list[int], src: psycopg.Connection[Any],
                   dst: psycopg.Connection[Any]) -> list[PartDone]:
    """One target transaction: the group's partitions not yet recorded, each run of consecutive ones in one COPY
    (its rows and bytes recorded on its first partition, 0 on the others), their records, then the run check
    (``check_run``, the row locked) before the commit."""
    done_q, record_q, _ = parts_sql("%s")
    out: dict[int, PartDone] = {}
    with dst.transaction():
        todo = [p for p in group if not dst.execute(done_q, [plan.name, plan.run, plan.tbl, p]).fetchone()]
        for run in consecutive(todo):
            rows, nbytes = _stream_pg(plan, run, src, dst)
            out.update({p: PartDone(p, rows, nbytes, False) if p == run[0] else PartDone(p, 0, 0, False) for p in run})
        if todo:  # the records first: a run starting anew deletes them before it waits for the run row's lock
            dst.cursor().executemany(record_q, [[plan.name, plan.run, plan.tbl, p, out[p].rows, out[p].nbytes]
                                                for p in todo])
            check_run(plan, dst, "%s", lock=True)
    return [out.get(p) or PartDone(p, 0, 0, True) for p in group]


def consecutive(parts: list[int]) -> list[list[int]]:
    """``parts`` (ascending) in runs of consecutive partitions."""
    runs: list[list[int]] = []
    for p in parts:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _stream_pg(plan: CopyPlan, run: list[int], src: psycopg.Connection[Any],
               dst: psycopg.Connection[Any]) -> tuple[int, int]:
    """Stream consecutive partitions ``run`` (their pages as one range) from the source's COPY into the target's;
    (rows, bytes)."""
    fmt = "binary" if plan.binary else "text"
    lo, hi = plan.source["ranges"][run[0]][0], plan.source["ranges"][run[-1]][1]
    # the name the driver follows the copy's progress by (pg_stat_progress_copy): the run's first partition
    src.execute("SELECT set_config('application_name', %s, false)", [f"{plan.source['app']} p{run[0]}"])
    with dst.cursor().copy(f"COPY {plan.table} ({', '.join(plan.columns)}) FROM STDIN (FORMAT {fmt})") as cout:
        return relay(src, f"COPY ({range_query(plan.source, lo, hi)}) TO STDOUT (FORMAT {fmt})", cout.write)


def relay(src: psycopg.Connection[Any], copy_to: str, write: Callable[[bytearray], Any]) -> tuple[int, int]:
    """Run ``copy_to`` (a ``COPY … TO STDOUT``) on ``src`` and hand its data to ``write`` in chunks of about
    ``COPY_CHUNK`` bytes of whole rows; (rows, bytes). The rows are read straight from libpq (``PQgetCopyData``, a
    row a call): psycopg's COPY iteration costs more than twice the CPU per row (bench/README.md, sync), and the
    task relaying the rows shares the machine with both servers. The error of a failed COPY is raised as psycopg
    raises it."""
    pg = src.pgconn
    # waits in poll, without the GIL (the driver copies small tables itself, beside its progress and key-building
    # threads; a read that blocks in libpq holds the GIL, and a Ctrl-C, until the server answers)
    poller = select.poll()
    poller.register(pg.socket, select.POLLIN)

    def answered() -> None:  # the server's next result is complete
        while pg.is_busy():
            poller.poll()
            pg.consume_input()

    with src.lock:
        pg.send_query(copy_to.encode())
        results = []
        nbytes = 0
        answered()
        first = pg.get_result()
        if first is not None and first.status == pq.ExecStatus.COPY_OUT:
            get, consume = pg.get_copy_data, pg.consume_input
            buf = bytearray()
            while True:
                # a row already received, else 0: wait for more (-1 at the end; a failed read raises: psycopg)
                n, data = get(1)
                if n == 0:
                    poller.poll()
                    consume()
                    continue
                if n < 0:
                    break
                buf += data
                if len(buf) >= COPY_CHUNK:
                    write(buf)
                    nbytes += len(buf)
                    buf = bytearray()
            if buf:
                write(buf)
                nbytes += len(buf)
        elif first is not None:
            results.append(first)
        answered()
        while (res := pg.get_result()) is not None:
            results.append(res)
            answered()
    end = results[-1] if results else None
    if end is None or end.status != pq.ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(end, "utf-8") if end is not None else psycopg.OperationalError(
            f"the source's COPY ended without a result: {pg.get_error_message()}")
    return int(end.command_status.split()[-1]) if end.command_status else 0, nbytes


def check_run(plan: CopyPlan, conn: Any, ph: str, lock: bool) -> None:
    """CopyError unless ``plan.run`` is still the copy under way (checked in the transaction that writes, before it
    commits; ``lock``: the row locked ``FOR SHARE`` until then): the sync row of ``plan.name`` (a full sync) or the
    ``applier_sync_tables`` row of ``plan.joining`` (``sync --table``) names this run and is 'copying'. A sync that
    starts, or a table's copy that starts again, replaces that row (and so waits for a locked one): a partition of an
    older run (a task of a killed run still running on a cluster, or a straggler of a failed attempt) either
    commits before that, or rolls back here; never after the new run has emptied the table."""
    if plan.joining is None:
        sql, params = (f"SELECT 1 FROM applier_sync WHERE name = {ph} AND run = {ph} AND state = 'copying'",
                       [plan.name, plan.run])
    else:
        sql, params = (f"SELECT 1 FROM applier_sync_tables WHERE name = {ph} AND schema_name = {ph} "
                       f"AND table_name = {ph} AND run = {ph} AND state = 'copying'", [plan.name, *plan.joining, plan.run])
    if conn.execute(sql + (" FOR SHARE" if lock else ""), params).fetchone() is None:
        raise CopyError(f"sync run {plan.run[:8]} of {plan.name!r} is no longer the copy of {plan.tbl} under way "
                        f"(a newer run replaced it, or it ended): its partitions are not written")
