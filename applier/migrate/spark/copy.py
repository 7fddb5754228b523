"""Copying one table as a Spark job: ``applier_pg`` (source, in the exported snapshot) → ``applier_target``.

``applier_target`` is a PySpark Python Data Source writer (Arrow batches). Each
Spark partition (one page range of the source table) is written in **one
target transaction** that also inserts its row into ``applier_sync_parts``
(name, run, table, partition). Before writing, the partition looks for that
row and skips itself if it is there, so a partition retried by Spark or by
``copy_table`` (same run, snapshot still open) is written exactly once; two
concurrent attempts collide on the row's primary key and one rolls back.

- PostgreSQL: ``COPY … FROM STDIN (FORMAT csv)`` of the batches (pyarrow writes
  the CSV), ``synchronous_commit = off`` (``applier.migrate.sync`` makes everything
  durable with its last commit), ``session_replication_role = replica`` when the
  role may (no triggers, no foreign-key checks, as for replicated rows).
- SQLite: batched ``executemany`` inserts with the apply engine's converters
  (``sqlite_text_converters``); ``BEGIN IMMEDIATE`` takes SQLite's write lock for
  the whole partition, so partitions write one at a time (the others wait for
  the lock); ``synchronous = NORMAL`` in WAL mode, made durable by the final
  ``synchronous = FULL`` commit of ``applier.migrate.sync``.

Progress: the driver polls ``applier_sync_parts`` (finished partitions, exact)
and the source's ``pg_stat_progress_copy`` (running partitions, by
``application_name``) while the job runs.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from applier.decoder.messages import Column, Relation
from applier.errors import ApplyError
from applier.targets.values import sqlite_text_converters

PARTS_DDL = ("CREATE TABLE IF NOT EXISTS applier_sync_parts (name TEXT NOT NULL, run TEXT NOT NULL, "
             "tbl TEXT NOT NULL, part INTEGER NOT NULL, rows BIGINT NOT NULL, bytes BIGINT NOT NULL, "
             "PRIMARY KEY (name, run, tbl, part))")
SQLITE_LOCK_WAIT = 86400.0  # seconds a SQLite partition waits for the write lock
_WRITE_CSV = pacsv.WriteOptions(include_header=False)


class CopyError(ApplyError):
    """A table could not be copied; the message names the table and the cause."""


def parts_sql(ph: str) -> tuple[str, str, str]:
    """(is the partition done?, record it, list a table's parts) for a parameter style."""
    return (f"SELECT 1 FROM applier_sync_parts WHERE name = {ph} AND run = {ph} AND tbl = {ph} AND part = {ph}",
            f"INSERT INTO applier_sync_parts (name, run, tbl, part, rows, bytes) VALUES ({ph}, {ph}, {ph}, {ph}, {ph}, {ph})",
            f"SELECT part, rows, bytes FROM applier_sync_parts WHERE name = {ph} AND run = {ph} AND tbl = {ph}")


def target_plan(*, dialect: str, where: str, table: str, columns: list[str], types: list[int], name: str, run: str,
                tbl: str) -> str:
    """The ``plan`` option of ``applier_target``: where: libpq DSN or SQLite path; quoted table and columns."""
    return json.dumps({"dialect": dialect, "where": where, "table": table, "columns": columns, "types": types,
                       "name": name, "run": run, "tbl": tbl})


@dataclass
class PartDone(WriterCommitMessage):
    """What one partition wrote."""

    part: int
    rows: int
    nbytes: int
    skipped: bool


class _Writer(DataSourceArrowWriter):
    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartDone:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx is not None else 0
        if self.plan["dialect"] == "sqlite":
            return write_sqlite_partition(self.plan, part, iterator)
        return write_pg_partition(self.plan, part, iterator)


class TargetSink(DataSource):
    """``df.write.format("applier_target").option("plan", target_plan(…)).mode("append").save()``."""

    @classmethod
    def name(cls) -> str:
        return "applier_target"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return _Writer(json.loads(self.options["plan"]))


def _data_bytes(batch: pa.RecordBatch) -> int:
    total = 0
    for col in batch.columns:
        s = pc.sum(pc.binary_length(col)).as_py()
        total += s or 0
    return total


def write_pg_partition(plan: dict[str, Any], part: int, batches: Iterator[pa.RecordBatch]) -> PartDone:
    """Write one partition to a PostgreSQL table with COPY, recording it in the same transaction."""
    done_q, record_q, _ = parts_sql("%s")
    key = [plan["name"], plan["run"], plan["tbl"], part]
    conn = psycopg.connect(plan["where"], autocommit=True, application_name=f"applier-sync write p{part}",
                           options="-c client_encoding=UTF8")
    try:
        conn.execute("SET synchronous_commit = off")
        try:
            conn.execute("SET session_replication_role = replica")
        except psycopg.Error:
            pass
        rows = nbytes = 0
        with conn.transaction():
            if conn.execute(done_q, key).fetchone():
                return PartDone(part, 0, 0, True)
            stmt = f"COPY {plan['table']} ({', '.join(plan['columns'])}) FROM STDIN WITH (FORMAT csv)"
            with conn.cursor().copy(stmt) as cp:
                for batch in batches:
                    if batch.num_rows == 0:
                        continue
                    sink = pa.BufferOutputStream()
                    pacsv.write_csv(batch, sink, _WRITE_CSV)
                    cp.write(memoryview(sink.getvalue()))
                    rows += batch.num_rows
                    nbytes += _data_bytes(batch)
            conn.execute(record_q, [*key, rows, nbytes])
        return PartDone(part, rows, nbytes, False)
    finally:
        conn.close()


def _sqlite_column(arr: pa.Array, conv: Callable[[bytes], Any]) -> list[Any]:
    if conv is bytes.decode:
        out: list[Any] = arr.cast(pa.string()).to_pylist()
        return out
    if conv is int:
        out = pc.cast(arr.cast(pa.string()), pa.int64()).to_pylist()
        return out
    return [None if v is None else conv(v) for v in arr.to_pylist()]


def write_sqlite_partition(plan: dict[str, Any], part: int, batches: Iterator[pa.RecordBatch]) -> PartDone:
    """Write one partition to a SQLite table with batched inserts, holding the write lock throughout."""
    done_q, record_q, _ = parts_sql("?")
    key = [plan["name"], plan["run"], plan["tbl"], part]
    rel = Relation(None, 0, "", "", "d", tuple(Column(0, f"c{i}", t, -1) for i, t in enumerate(plan["types"])))
    convs = sqlite_text_converters(rel)
    insert = (f"INSERT INTO {plan['table']} ({', '.join(plan['columns'])}) "
              f"VALUES ({', '.join('?' * len(plan['columns']))})")
    conn = sqlite3.connect(plan["where"], timeout=SQLITE_LOCK_WAIT, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute(done_q, key).fetchone():
                conn.execute("ROLLBACK")
                return PartDone(part, 0, 0, True)
            rows = nbytes = 0
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                cols = [_sqlite_column(arr, conv) for arr, conv in zip(batch.columns, convs, strict=True)]
                conn.executemany(insert, zip(*cols))
                rows += batch.num_rows
                nbytes += _data_bytes(batch)
            conn.execute(record_q, [*key, rows, nbytes])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return PartDone(part, rows, nbytes, False)
    finally:
        conn.close()


# -- driver side -------------------------------------------------------------------------------

_PY_ERROR = re.compile(r"^\s*((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Violation|Failure)): (.+)$")
_PY_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.+)$")  # the line ending a Python traceback: 'module.Class: message'
_PY_WORKER = re.compile(r"Error from python worker:\s*(.*?)\s*PYTHONPATH was:", re.S)  # it died before running


def spark_error_line(exc: BaseException) -> str:
    """The Python error at the bottom of a failed Spark job's message, else its first line."""
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
    """Polls a table's progress while its Spark job runs and hands running totals to ``on_update``."""

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


def run_copy_job(spark: Any, source_plan: str, target_plan_json: str, label: str) -> None:
    """Run the Spark job copying one table; CopyError naming the table on failure."""
    spark.sparkContext.setJobDescription(f"applier sync: copy {label}")
    try:
        df = spark.read.format("applier_pg").option("plan", source_plan).load()
        df.write.format("applier_target").option("plan", target_plan_json).mode("append").save()
    except Exception as exc:  # noqa: BLE001 - Spark wraps everything; keep the cause's line
        raise CopyError(f"copying {label} failed: {spark_error_line(exc)}") from exc
    finally:
        spark.sparkContext.setJobDescription(None)
