"""Copying a table's partitions, the rows never passing through Spark's JVM.

A partition is one page range of the source table (``applier.migrate.spark.source.ctid_ranges``), read
with ``COPY (SELECT cols FROM [ONLY] t WHERE ctid range [AND (row filter)]) TO STDOUT`` inside the
exported snapshot (``applier.migrate.spark.pgread.pg_in_snapshot``: pinned output settings,
``application_name`` ``<app> p<n>``). Each partition is written in **one target transaction** (on PostgreSQL
together with the other partitions of its group, below) that also inserts its row into ``applier_sync_parts``
(name, run, table, partition). Before writing, the partition
looks for that row and skips itself if it is there, so a partition retried by Spark or by ``sync`` (same
run, snapshot still open) is written exactly once; two concurrent attempts collide on the row's primary
key and one rolls back. Before that transaction commits, ``check_run`` makes sure that its run is still the
copy under way (the sync row, or the table's ``applier_sync_tables`` row for ``sync --table``, locked on
PostgreSQL): a task of a killed run that still runs on a cluster, or a straggler of a failed attempt, rolls
back instead of writing into a table that a newer run has emptied.

- PostgreSQL target: one Spark job per table (on a local master not a small one, nor any where the master copies one
  stream at a time: below), as many tasks as the session streams at once
  (``applier.migrate.spark.session.copy_streams``: a cluster's task slots, half a local master's threads; a
  Spark task costs tens of milliseconds), each with a slice of consecutive partitions (``task_groups``):
  Spark spreads the tasks over the executors (local or a cluster), retries them (a retried task skips its
  partitions already written), and reports failures. A task opens both ends itself and copies its partitions
  in **groups** of consecutive ones of at most ``GROUP_PAGES`` pages together (every leaf of a partitioned
  table and TOAST weighed in: ``CopyPlan.weight``): a group is one source
  COPY of its pages, streamed in chunks of whole rows into ``COPY t (cols) FROM STDIN`` on the target, in
  one target transaction with every one of its partitions' ``applier_sync_parts`` rows (its rows and bytes
  on the first; a partition's rows and its record still commit together, and a rerun skips exactly the
  recorded ones). A COPY per partition would cost a pipeline drain each (the target finishing the data in
  flight while the source waits, ~17 ms a partition on the development machine: bench/README.md, sync), so
  more partitions than streams would be slower than one. Spark only sees the small ``PartDone`` records.
  Binary format when ``binary_safe`` (every column's type
  ``applier.targets.binary.binary_copy_safe``: a built-in one with binary I/O whose binary input takes all of its
  binary output, that does not name catalog objects by OID; and the same type on the target: a binary
  ``regclass`` is the source's OID of a relation, an empty tsquery's binary form is refused by tsquery's binary
  input, and arrays and composites of user types carry the source's type OIDs, which differ on the target and
  which servers without PostgreSQL's later leniency reject), text otherwise (both ends with the pinned date, interval and
  time zone settings). Binary is the faster (bench/README.md, sync).
  ``synchronous_commit = off`` (``applier.migrate.sync`` makes everything durable with its last commit),
  ``session_replication_role = replica`` when the role may (no triggers, no foreign-key checks, as for
  replicated rows).
- On a local master, a PostgreSQL target's small table (``applier.migrate.sync.by_spark``: at most ``DRIVER_PAGES``
  pages, every leaf and TOAST weighed in), and every table where the master copies one stream at a time, is copied by
  the driver itself, as the one task of the job above would copy it (``copy_pg_partitions``: the same groups,
  records and run check): the task would run on this machine anyway, and a job's fixed cost (scheduling it, a round
  trip to a Python worker: about 0.1 s; the first job's JVM and Python worker: seconds) is more than such a copy
  takes, or all that Spark would add to it.
  A sync that copies every table so starts no Spark at all. On a cluster every table is a job (its executors are
  where the copy is meant to run).
- SQLite target (a file of the driver's; no Spark): its readers and one writer, ``applier.migrate.spark.sqlitecopy``;
  a partition is at most ``SQLITE_PART_PAGES`` heap pages (``partitions_for``: about a second of writing).

``PartDone.nbytes`` (and the ``bytes`` of ``applier_sync_parts``): the COPY data moved (PostgreSQL, in its
format) or the values' bytes (SQLite).

Progress: the driver polls ``applier_sync_parts`` (finished partitions, exact) and the source's
``pg_stat_progress_copy`` (running copies, by ``application_name``: a group's under its first partition) while
the copy runs.

The task side of a PostgreSQL target's copy (``copy_pg_partitions``), what travels to it (``CopyPlan``) and the
records and run check every writer shares are in ``applier.migrate.spark.pgcopy``; this module is the driver's side.
Neither loads pyspark nor pyarrow: a PostgreSQL target's copy by the driver needs them not (the SQLite writer,
which does, is loaded when a SQLite target is copied).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Collection
from typing import Any

import psycopg

from applier.migrate.spark.pgcopy import (
    CopyError,
    CopyPlan,
    PartDone,
    consecutive,
    copy_pg_partitions,
)
from applier.migrate.spark.session import context_of, copy_streams, reraise_interrupt
from applier.targets.backend import Backend
from applier.targets.backends import backend
from applier.targets.binary import binary_copy_safe
from applier.text import one_line

# heap pages (8 kB) of a SQLite target's partition at most: ~8 MB of rows, written in about a second
SQLITE_PART_PAGES = 1024
# pages (8 kB, weighed by ``CopyPlan.weight``) of a PostgreSQL target's group of partitions at most (one source
# COPY, one target transaction): 1 GiB, about 10 s of copying on the development machine; a failed group is copied
# again whole
GROUP_PAGES = 1 << 17

def partitions_for(target: Backend, pages: int, partitions: int) -> int:
    """How many partitions to ask ``ctid_ranges`` for a table of ``pages`` heap pages: ``partitions``
    (``spark.partitions``), or more for a SQLite target so that none exceeds ``SQLITE_PART_PAGES`` (see the
    module header: how long the write lock is held)."""
    if target.copies_by_spark:
        return partitions
    return max(partitions, -(-pages // SQLITE_PART_PAGES))


def binary_safe(target: psycopg.Connection[Any], qtarget: str, columns: list[tuple[str, int]]) -> bool:
    """Whether a table's (name, source type OID) columns can be copied in COPY's binary format into the
    PostgreSQL target table ``qtarget``: every type ``binary_copy_safe`` (a built-in one whose binary form the
    target reads back as it was), and each target column of the same type."""
    if not columns or not all(binary_copy_safe(oid) for _, oid in columns):
        return False
    on_target = dict(target.execute(
        "SELECT attname, atttypid::int FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 "
        "AND NOT attisdropped", [qtarget]).fetchall())
    return all(on_target.get(name) == oid for name, oid in columns)


_PY_ERROR = re.compile(r"^\s*((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Violation|Failure)): (.+)$")
_PY_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.+)$")  # the line ending a Python traceback: 'module.Class: message'
_PY_WORKER = re.compile(r"Error from python worker:\s*(.*?)\s*PYTHONPATH was:", re.S)  # it died before running


def driver_error_line(exc: BaseException) -> str:
    """An error the driver met running a job's tasks itself (a small copy, ``applier.migrate.spark.rangehash``'s
    sums on a local master), as the same error in a Spark task reads (``spark_error_line``): its class and, for a
    server's error, its message alone (its DETAIL, CONTEXT and a COPY line may quote the rows' values)."""
    said = exc.diag.message_primary if isinstance(exc, psycopg.Error) else None
    return f"{type(exc).__name__}: {said or one_line(exc)}"


# the modules of errors the driver meets reading rows itself (a SQLite file, the Arrow data of verify's small tables)
_DRIVER_READS = frozenset(("sqlite3", "pyarrow.lib"))


def spark_error_line(exc: BaseException) -> str:
    """The Python error at the bottom of a failed Spark job's message, else its first line; a server's error, or a
    SQLite or Arrow one, that the driver met itself as ``driver_error_line`` says it."""
    if isinstance(exc, psycopg.Error) or type(exc).__module__ in _DRIVER_READS:
        return driver_error_line(exc)
    text = str(exc)
    lines = text.splitlines()
    m = _PY_WORKER.search(text)
    if m:
        return (f"the workers' Python failed: {' '.join(m.group(1).split())[:300]} (point spark.pyspark.python or "
                f"PYSPARK_PYTHON at a Python 3.11 with pyspark, psycopg and pyarrow)")
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith("Traceback (most recent call last):")]
    if starts:  # a Python traceback: its exception is the first line after it that is not indented
        raised = next((line for line in lines[starts[-1] + 1:] if line and not line[0].isspace()), "")
        m = _PY_RAISED.match(raised)
        if m:
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    for line in reversed(lines):
        m = _PY_ERROR.match(line)
        if m and not m.group(1).startswith(("py4j", "org.apache", "java.")):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    return " ".join(text.split())[:500]


class CopyWatcher:
    """Polls a table's progress while it is copied (its Spark job, or the driver) and hands running totals to
    ``on_update``."""

    def __init__(self, read_parts: Callable[[], dict[int, tuple[int, int]]],
                 read_running: Callable[[], dict[int, tuple[int, int]]],
                 on_update: Callable[[int, int], None], every: float = 0.5) -> None:
        self.read_parts = read_parts
        self.read_running = read_running
        self.on_update = on_update
        self.every = every
        self.seen: dict[int, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="applier-copy-progress", daemon=True)

    def __enter__(self) -> CopyWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def poll(self) -> tuple[int, int]:
        """One look: (rows, bytes) so far."""
        running = self.read_running()
        for part, (r, b) in running.items():
            old = self.seen.get(part, (0, 0))
            self.seen[part] = (max(old[0], r), max(old[1], b))
        done = self.read_parts()
        for part, rb in done.items():
            self.seen[part] = rb
        rows = sum(r for r, _ in self.seen.values())
        nbytes = sum(b for _, b in self.seen.values())
        return rows, nbytes

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.on_update(*self.poll())
            except Exception:  # noqa: BLE001 - progress is best effort
                pass


def running_copies(conn: psycopg.Connection[Any], app: str) -> dict[int, tuple[int, int]]:
    """(rows, bytes) of the running COPY TO of each partition whose application_name is ``<app> p<n>``."""
    out = {}
    for name, tuples, nbytes in conn.execute(
            "SELECT a.application_name, p.tuples_processed, p.bytes_processed FROM pg_stat_progress_copy p "
            "JOIN pg_stat_activity a ON a.pid = p.pid WHERE a.application_name LIKE %s", [app + " p%"]):
        try:
            out[int(name.rsplit(" p", 1)[1])] = (int(tuples or 0), int(nbytes or 0))
        except (ValueError, IndexError):
            continue
    return out


def task_groups(plan: CopyPlan, parts: list[int], streams: int) -> list[list[list[int]]]:
    """The Spark tasks of a PostgreSQL target's copy of ``parts`` (ascending): at most ``streams`` tasks of
    consecutive partitions each (as many as can be), each task's partitions in groups of consecutive ones of at
    most ``GROUP_PAGES`` pages together (weighed by ``CopyPlan.weight``: every leaf of a partitioned table, TOAST;
    at least one partition), a group copied in one source COPY and one target transaction (``copy_pg_partitions``)."""
    tasks = max(1, min(len(parts), streams))
    ranges = plan.source["ranges"]
    width = ranges[0][1] if len(ranges) > 1 else None  # pages of a partition (ctid_ranges: all about the same)
    # a partitioned table's range covers every leaf, and TOAST comes with the rows: weighed by the whole table
    size = max(1, int(GROUP_PAGES // max(1.0, width * plan.weight))) if width else 1
    out = []
    for i in range(tasks):
        mine = parts[i * len(parts) // tasks:(i + 1) * len(parts) // tasks]
        out.append([g[k:k + size] for g in consecutive(mine) for k in range(0, len(g), size)])
    return out


def copy_partitions(spark: Any, plan: CopyPlan, done: Collection[int], label: str) -> list[PartDone]:
    """Copy the table's partitions not in ``done`` (see the module header): a Spark job for a PostgreSQL target
    (``spark`` None: the driver copies them as one task would, ``by_spark``), the driver's readers and writer for
    a SQLite one. CopyError naming the table and the cause on failure."""
    parts = [p for p in range(plan.partitions) if p not in done]
    if not parts:
        return []
    if spark is None or not backend(plan.kind).copies_by_spark:
        if not backend(plan.kind).copies_by_spark:
            # here, not at the top: start-up time (pyarrow and pyspark, which a PostgreSQL target's copy needs not)
            from applier.migrate.spark.sqlitecopy import copy_sqlite_partitions
        try:
            if backend(plan.kind).copies_by_spark:
                return copy_pg_partitions(plan, task_groups(plan, parts, 1)[0])
            return copy_sqlite_partitions(plan, parts)
        except Exception as exc:  # noqa: BLE001 - either end's error, as one line
            raise CopyError(f"copying {label} failed: {driver_error_line(exc)}") from exc
    sc = context_of(spark)
    sc.setJobDescription(f"applier sync: copy {label}")
    work = task_groups(plan, parts, copy_streams(spark))
    try:
        out: list[PartDone] = sc.parallelize(work, len(work)).flatMap(
            functools.partial(copy_pg_partitions, plan)).collect()
        return out
    except Exception as exc:  # noqa: BLE001 - Spark wraps everything; keep the cause's line
        reraise_interrupt(exc)
        raise CopyError(f"copying {label} failed: {spark_error_line(exc)}") from exc
    finally:
        with contextlib.suppress(Exception):  # after an interrupt py4j's connection may be broken: the cause wins
            sc.setJobDescription(None)
