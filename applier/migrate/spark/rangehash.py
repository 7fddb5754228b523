"""Per-key-range row counts and hashes computed on the PostgreSQL servers, for ``applier verify``.

Between a PostgreSQL source and a PostgreSQL target a table is compared without its rows leaving the
servers: each side's query returns, per key range, the row count and two sums of 64-bit row hashes
(at most ``RANGES`` small rows); the driver compares them, and only the rows of the ranges that differ
are read (``bucket_filter``) to name the differing keys.

Canonical text, the same on both servers: a row is ``ROW(c1, …, cN)::text`` (the record output of its
columns' text output: NULL is empty, an empty string ``""``, so the form is unambiguous), its key
``ROW(k1, …)::text`` (the whole row for a table without a key). Both sessions pin the output settings
(``applier.migrate.spark.pgread.pinned_dsn``: ISO dates, UTC, ``intervalstyle = postgres``,
``extra_float_digits = 3``, hex bytea), so the text is equal exactly when the values are, provided
each column has the same type on both sides (``same_types``: schema, name and modifier) and the two
servers share an encoding (``md5`` hashes the server-encoded bytes): otherwise verify reads the rows
(the Spark path). ``md5`` (not ``hashtextextended``) because its result does not depend on the
server's version or byte order.

- key range ("bucket"): the top ``KEY_BITS`` bits of ``md5(key text)``: the same range on both sides,
  whatever the target's collation or physical order;
- row hash: ``md5(row text)`` as two signed 64-bit halves, summed per range (``sum(bigint)`` is
  ``numeric``: no overflow; a sum, not a XOR, so duplicate rows count).

Scheduling: one Spark job per table, or per batch of small tables (``tables_range_sums``: a Spark job
costs more than a small table's sums); the items are the ctid page ranges of both sides of each table
(``applier.migrate.spark.source.ctid_ranges``), a task runs every k-th item (k: the session's task
slots) on one connection a side, a range a transaction (the source's in the exported snapshot,
``snapshot_transaction``), and returns the partial sums of its page ranges; the driver adds them up.
Spark sees only those sums. On a local master the driver runs the same tasks itself, one thread each
(the work is the servers', the threads wait on them): Spark would only schedule them on this machine,
after its JVM had started.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg

from applier.migrate.spark.pgread import pg_connect, range_query, snapshot_transaction
from applier.migrate.spark.session import task_slots

KEY_BITS = 10  # 1024 key ranges, as the Spark path
RANGES = 1 << KEY_BITS

Sums = tuple[int, int, int]  # rows, sum of the first hash halves, sum of the second
CANCEL_WAIT = 2.0  # seconds: a cancel request's wait for its server; how long an interrupt keeps cancelling
T = TypeVar("T")
U = TypeVar("U")


def row_text(columns: Sequence[str]) -> str:
    """SQL for the canonical text of a row of these (quoted) columns or expressions."""
    return f"ROW({', '.join(columns)})::text"


def _bucket_of(md5_hex: str, bits: int = KEY_BITS) -> str:
    """SQL for the top ``bits`` bits (at most 60) of an md5 (hex) as a bigint: with ``KEY_BITS``, the key range; with
    more, a part of it (its range: the part's number shifted right by ``bits - KEY_BITS``)."""
    digits = -(-bits // 4)
    return f"(('x' || lpad(left({md5_hex}, {digits}), 16, '0'))::bit(64)::bigint >> {4 * digits - bits})"


def bucket_of(key: Sequence[str], bits: int = KEY_BITS) -> str:
    """SQL for the key range (or, with more ``bits``, the part of one) of a row whose key is these (quoted)
    columns."""
    return _bucket_of(f"md5({row_text(key)})", bits)


def bucket_filter(key: Sequence[str], buckets: Sequence[int], bits: int = KEY_BITS) -> str:
    """A condition selecting the rows whose key (quoted columns) lies in one of these ranges (or parts)."""
    return f"{bucket_of(key, bits)} IN ({', '.join(str(int(b)) for b in buckets)})"


def sums_query(plan: dict[str, Any], lo: int | None, hi: int | None) -> str:
    """The per-range count and hash sums of one page range of a ``hash_plan``."""
    inner = range_query(plan, lo, hi)
    key = "k" if plan["keyed"] else "m"
    cols = "md5(r) AS m, md5(k) AS k" if plan["keyed"] else "md5(r) AS m"
    return (f"SELECT {_bucket_of(key, plan.get('bits', KEY_BITS))} AS b, count(*), sum(('x' || left(m, 16))::bit(64)::bigint), "
            f"sum(('x' || right(m, 16))::bit(64)::bigint) FROM (SELECT {cols} FROM ({inner}) AS q) AS h GROUP BY 1")


def hash_plan(plan: dict[str, Any], columns: list[str], key: list[str], bits: int = KEY_BITS) -> dict[str, Any]:
    """A ``pg_plan`` (parsed) turned into the plan of ``sums_query``: its columns (quoted names or SQL, in the
    order of the comparison) become the row text ``r`` and, when ``key`` (quoted) is not empty, the key text
    ``k``; the sums are per key range, or with more ``bits`` per part of one."""
    exprs = [f"{row_text(columns)} AS r"] + ([f"{row_text(key)} AS k"] if key else [])
    return {**plan, "columns": exprs, "keyed": bool(key), "bits": bits}


def _sums_of(tables: list[list[dict[str, Any]]], items: list[tuple[int, int, int]],
             running: Running | None = None) -> list[tuple[int, int, int, Sums]]:
    """(table, side, bucket, sums) of page ranges ``items`` ((table, side, range index)): a Spark task's work, or
    a driver's thread's (its connection in ``running`` while it queries, to be cancelled). The ranges of one server
    are read on one connection (a connection costs each side several ms, and a verify of many small tables has two
    ranges a table), each in a transaction of its own in the plan's snapshot (no lock nor transaction held between
    them)."""
    out = []
    with contextlib.ExitStack() as opened:
        conns: dict[str, psycopg.Connection[Any]] = {}
        for table, side, index in items:
            plan = tables[table][side]
            lo, hi = plan["ranges"][index]
            conn = conns.get(plan["dsn"])
            if conn is None:
                conn = conns[plan["dsn"]] = opened.enter_context(contextlib.closing(pg_connect(plan, index)))
            with snapshot_transaction(conn, plan), (
                    running.holding(conn) if running is not None else contextlib.nullcontext()):
                for b, n, s1, s2 in conn.execute(sums_query(plan, lo, hi)):
                    out.append((table, side, int(b), (int(n), int(s1), int(s2))))
    return out


def range_sums(spark: Any, source: dict[str, Any], target: dict[str, Any]) -> tuple[dict[int, Sums], dict[int, Sums]]:
    """Per-range sums of both sides (``hash_plan``s), computed on the servers in one Spark job (see the module
    header); a failure raises Spark's exception (the caller reports its cause)."""
    return tables_range_sums(spark, [(source, target)])[0]


def tables_range_sums(spark: Any, tables: Sequence[tuple[dict[str, Any], dict[str, Any]]], threads: int = 0
                      ) -> list[tuple[dict[int, Sums], dict[int, Sums]]]:
    """``range_sums`` of several tables (each its source and target ``hash_plan``) in one Spark job, in their
    order; a failure of any raises Spark's exception. ``spark`` None: the driver runs the job's tasks itself,
    ``threads`` at once (``Running``), and a failure raises the task's own exception."""
    plans = [[source, target] for source, target in tables]
    items = [(t, side, i) for t, pair in enumerate(plans) for side in (0, 1) for i in range(len(pair[side]["ranges"]))]
    tasks = max(1, min(len(items), task_slots(spark) if spark is not None else threads))
    groups = [items[i::tasks] for i in range(tasks)]
    if spark is None:
        running = Running()
        parts = [part for done in running.run(functools.partial(_sums_of, plans, running=running), groups)
                 for part in done]
    else:
        parts = spark.sparkContext.parallelize(groups, tasks).flatMap(functools.partial(_sums_of, plans)).collect()
    out: list[tuple[dict[int, Sums], dict[int, Sums]]] = [({}, {}) for _ in plans]
    for t, side, b, (n, s1, s2) in parts:
        sums = out[t][side]
        n0, a0, b0 = sums.get(b, (0, 0, 0))
        sums[b] = (n0 + n, a0 + s1, b0 + s2)
    return out


class Running:
    """A job's tasks run by the driver (``run``), each in a thread of its own, with the connections they query on
    (``holding``): when the caller is interrupted (Ctrl-C) or a task fails, the queries under way are cancelled,
    as Spark's job would end its tasks, so that the servers stop hashing and the failure is raised at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: set[psycopg.Connection[Any]] = set()
        self._stopped = False

    @contextlib.contextmanager
    def holding(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """``conn``'s queries are cancelled if the job stops while it is held (at once if it has stopped)."""
        with self._lock:
            if self._stopped:
                raise psycopg.errors.QueryCanceled("the job stopped")
            self._conns.add(conn)
        try:
            yield
        finally:
            with self._lock:
                self._conns.discard(conn)

    def stop(self) -> None:
        """Cancel the queries under way, and any a task starts from now on. A server drops a cancel that reaches a
        connection before its query does (registered, not yet sent): ``run`` calls this again until its threads
        have ended."""
        with self._lock:
            self._stopped = True
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(psycopg.Error):  # the query ended meanwhile; a server that does not answer
                conn.cancel_safe(timeout=CANCEL_WAIT)

    def run(self, work: Callable[[T], U], items: Sequence[T]) -> list[U]:
        """``work(item)`` of every item, each in a daemon thread, in their order; the first failure (the one that
        stopped the others, whose cancelled queries fail after it) is raised once every thread has ended."""
        results: list[Any] = [None] * len(items)
        failed: list[BaseException] = []

        def one(i: int) -> None:
            try:
                results[i] = work(items[i])
            except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread, below
                with self._lock:
                    failed.append(exc)
                self.stop()

        threads = [threading.Thread(target=one, args=(i,), name=f"applier-verify-sums-{i}", daemon=True)
                   for i in range(len(items))]
        try:
            for thread in threads:
                thread.start()
            self._join(threads)
        except BaseException:
            # an interrupt: the servers' queries end (the threads, daemons, end with them), cancelled again for a
            # moment without holding the command up longer
            self.stop()
            self._join(threads, time.monotonic() + CANCEL_WAIT)
            raise
        if failed:
            raise failed[0]
        return results

    def _join(self, threads: list[threading.Thread], deadline: float | None = None) -> None:
        """Wait for ``threads`` to end (until ``deadline``, if given); once stopped, cancel again every little while:
        a cancel that reached a connection before its query did was dropped by the server."""
        for thread in threads:
            while thread.is_alive() and (deadline is None or time.monotonic() < deadline):
                thread.join(CANCEL_WAIT / 4)
                if self._stopped:
                    self.stop()


def server_encoding(conn: psycopg.Connection[Any]) -> str:
    """The server's encoding (``md5`` hashes text in it)."""
    row = conn.execute("SHOW server_encoding").fetchone()
    return str(row[0]) if row else ""


def target_types(conn: psycopg.Connection[Any], qtable: str) -> dict[str, tuple[str, str, int]]:
    """Column name -> (type schema, ``format_type(type, NULL)``, type modifier) of a PostgreSQL table."""
    return {r[0]: (r[1], r[2], int(r[3])) for r in conn.execute(
        "SELECT a.attname, n.nspname, format_type(a.atttypid, NULL), a.atttypmod FROM pg_attribute a "
        "JOIN pg_type t ON t.oid = a.atttypid JOIN pg_namespace n ON n.oid = t.typnamespace "
        "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped", [qtable])}


def same_types(source: Sequence[tuple[str, str, str, int]], target: dict[str, tuple[str, str, int]]) -> bool:
    """Whether every source column (name, type schema, type name, modifier) has the same type on the target."""
    return all(target.get(name) == (schema, tname, mod) for name, schema, tname, mod in source)
