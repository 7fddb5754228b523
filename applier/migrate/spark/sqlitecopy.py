"""A SQLite target's copy (``applier sync``; see ``applier.migrate.spark.copy``): no Spark, the driver's readers
and its one writer.

Up to ``SQLITE_READERS`` partitions are read at once
by threads on the driver (CSV parsed by pyarrow, values converted with the apply engine's
``sqlite_text_converters``), each read whole before it is written, and the one writer stores them one
after the other with batched ``executemany`` inserts (``BEGIN IMMEDIATE``; ``synchronous = NORMAL`` in
WAL mode, made durable by the final ``synchronous = FULL`` commit of ``applier.migrate.sync``). The write
lock is so held only while a partition is written, never while the source is read, and a partition is at
most ``SQLITE_PART_PAGES`` heap pages (``applier.migrate.spark.copy.partitions_for``: about a second of writing), so an ``applier
run`` writing the same file meanwhile (``sync --table``) waits that long at most, far inside its busy
timeout. At most ``SQLITE_READERS`` partitions are held in memory, read and not yet written.

``PartDone.nbytes`` (and the ``bytes`` of ``applier_sync_parts``): the values' bytes. ``sqlite_rows``: the rows of
a source query as the copy stores them (``applier repair``).
"""

from __future__ import annotations

import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from applier.decoder.messages import Column, Relation
from applier.migrate.spark.pgcopy import CopyError, CopyPlan, PartDone, check_run, parts_sql
from applier.migrate.spark.source import copy_chunks, csv_batches, read_pg_range
from applier.targets.sqlite.values import sqlite_text_converters

SQLITE_LOCK_WAIT = 86400.0  # seconds the SQLite writer waits for the write lock
SQLITE_READERS = 2  # partitions read (and held) at once for a SQLite target: the one being written, one ahead


def _data_bytes(batch: pa.RecordBatch) -> int:
    total = 0
    for col in batch.columns:
        s = pc.sum(pc.binary_length(col)).as_py()
        total += s or 0
    return total


def _sqlite_column(arr: pa.Array, conv: Callable[[bytes], Any]) -> list[Any]:
    if conv is bytes.decode:
        out: list[Any] = arr.cast(pa.string()).to_pylist()
        return out
    if conv is int:
        out = pc.cast(arr.cast(pa.string()), pa.int64()).to_pylist()
        return out
    return [None if v is None else conv(v) for v in arr.to_pylist()]


def sqlite_rows(src: psycopg.Connection[Any], query: str, types: list[int]) -> list[tuple[Any, ...]]:
    """The rows of a source ``query`` (on ``src``, in its snapshot) as a SQLite target stores them (the values
    converted as the copy converts them): ``applier repair``'s rows of a key range."""
    rel = Relation(None, 0, "", "", "d", tuple(Column(0, f"c{i}", t, -1) for i, t in enumerate(types)))
    convs = sqlite_text_converters(rel)
    names = [f"c{i}" for i in range(len(types))]
    out: list[tuple[Any, ...]] = []
    with src.cursor().copy(f"COPY ({query}) TO STDOUT WITH (FORMAT csv)") as cp:
        for batch in csv_batches(copy_chunks(cp), names):
            cols = [_sqlite_column(arr, conv) for arr, conv in zip(batch.columns, convs, strict=True)]
            out.extend(zip(*cols, strict=True))
    return out


class _SqliteReaders:
    """Reader threads of a SQLite copy: partition ``p``'s rows, converted and read whole, on ``take(p)``.

    Invariant: the k-th partition (in ``parts`` order) is read only once fewer than ``SQLITE_READERS``
    partitions before it are waiting to be written (``done`` counts the ones handled), so at most that many
    are held in memory, and the one the writer waits for is always among them (no deadlock).
    """

    def __init__(self, plan: CopyPlan, parts: list[int]) -> None:
        self.plan = plan
        rel = Relation(None, 0, "", "", "d", tuple(Column(0, f"c{i}", t, -1) for i, t in enumerate(plan.types)))
        self.convs = sqlite_text_converters(rel)
        self.order = {p: k for k, p in enumerate(parts)}
        self.handled = 0  # partitions the writer is done with
        self.room = threading.Condition()
        self.queues: dict[int, queue.Queue[Any]] = {p: queue.Queue(1) for p in parts}
        self.dropped: dict[int, threading.Event] = {p: threading.Event() for p in parts}
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(min(len(parts), SQLITE_READERS), thread_name_prefix="applier-sync-read")
        for p in parts:
            self.pool.submit(self._read, p)

    def _wanted(self, part: int) -> bool:
        return not (self.stop.is_set() or self.dropped[part].is_set())

    def _read(self, part: int) -> None:
        with self.room:
            while self._wanted(part) and self.order[part] >= self.handled + SQLITE_READERS:
                self.room.wait(0.2)
        if not self._wanted(part):
            return
        lo, hi = self.plan.source["ranges"][part]
        item: Any
        try:
            whole = []
            with contextlib.closing(read_pg_range(self.plan.source, part, lo, hi)) as batches:
                for batch in batches:
                    if batch.num_rows == 0:
                        continue
                    cols = [_sqlite_column(arr, conv) for arr, conv in zip(batch.columns, self.convs, strict=True)]
                    whole.append((list(zip(*cols)), _data_bytes(batch)))
                    if not self._wanted(part):
                        return
            item = whole
        except Exception as exc:  # noqa: BLE001 - the writer raises it when it reaches this partition
            item = exc
        if self._wanted(part):
            self.queues[part].put(item)

    def take(self, part: int) -> list[tuple[list[tuple[Any, ...]], int]]:
        """Partition ``part``'s batches (rows, value bytes), in order, once read whole; a reader's error is raised
        here."""
        while True:
            try:
                item = self.queues[part].get(timeout=0.2)
                break
            except queue.Empty:
                if self.stop.is_set():
                    raise CopyError(f"the reader of partition {part} stopped") from None
        if isinstance(item, Exception):
            raise item
        out: list[tuple[list[tuple[Any, ...]], int]] = item
        return out

    def done(self, part: int) -> None:
        """The writer is done with partition ``part`` (written, or skipped: its reader stops): the next may be read."""
        self.dropped[part].set()
        try:
            self.queues[part].get_nowait()  # read meanwhile, not wanted: not kept
        except queue.Empty:
            pass
        with self.room:
            self.handled += 1
            self.room.notify_all()

    def close(self) -> None:
        """Stop every reader, wait for them (their source connections closed)."""
        self.stop.set()
        self.pool.shutdown(wait=True, cancel_futures=True)


def copy_sqlite_partitions(plan: CopyPlan, parts: list[int]) -> list[PartDone]:
    """Copy partitions ``parts`` into a SQLite target: read in parallel, written one after the other, each in
    one transaction with its ``applier_sync_parts`` row (see the module header). Stops at the first error."""
    done_q, record_q, _ = parts_sql("?")
    insert = (f"INSERT INTO {plan.table} ({', '.join(plan.columns)}) "
              f"VALUES ({', '.join('?' * len(plan.columns))})")
    out = []
    readers = _SqliteReaders(plan, parts)
    try:
        conn = sqlite3.connect(plan.target, timeout=SQLITE_LOCK_WAIT, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous = NORMAL")
            for part in parts:
                key = [plan.name, plan.run, plan.tbl, part]
                # read whole before the write lock is taken; written once: looked for again under the lock
                whole = [] if conn.execute(done_q, key).fetchone() else readers.take(part)
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if conn.execute(done_q, key).fetchone():
                        conn.execute("ROLLBACK")
                        readers.done(part)
                        out.append(PartDone(part, 0, 0, True))
                        continue
                    rows = nbytes = 0
                    for batch, size in whole:
                        conn.executemany(insert, batch)
                        rows += len(batch)
                        nbytes += size
                    check_run(plan, conn, "?", lock=False)  # the write lock serializes the writers already
                    conn.execute(record_q, [*key, rows, nbytes])
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                del whole
                readers.done(part)
                out.append(PartDone(part, rows, nbytes, False))
        finally:
            conn.close()
    finally:
        readers.close()
    return out
