"""``applier verify``: compare every replicated table, source against target, as Spark jobs.

Consistency: both sides must show the same moment.

1. No daemon may apply meanwhile: the slot must be inactive (``applier run``
   stopped), checked before and after; the target's recorded position must
   not move during the comparison (checked after), else verify fails.
2. A *temporary* logical slot is created on a replication connection with
   ``SNAPSHOT 'export'``: an exported snapshot S and its consistent point C.
   S sees exactly the transactions whose commit record lies before C; the
   connection stays open and idle until the comparison ends (S lives as long
   as it does; the temporary slot is dropped when it closes).
3. The target is brought to exactly C: the normal apply ``Runner`` (catch-up
   mode, the configured slot) reads through ``StopBefore(C)``, a source wrapper
   that withholds the first transaction whose commit is at or after C (Begin's
   final LSN, or the commit LSN of a streamed or prepared transaction, read from
   the message's bytes by the decoder's ``decision_position``) and ends
   the stream there, or ends it when a keepalive shows the server has sent
   everything before C. Commit records never straddle C, so the transactions
   applied are exactly those S sees. The withheld ones stay in the slot for
   the next ``run`` / ``catchup``: nothing is lost or skipped.
4. Source partitions read in S (``SET TRANSACTION SNAPSHOT``), target
   partitions read the target as it is (nothing writes to it now).

Comparison, per published table (same column lists and row filters as the
copy, the table's own rows as ``SourceTable.only`` says: an inheritance
parent without its children, a partitioned root published via the root with
its partitions'; the target's own rows likewise), in Spark:

- each row becomes its canonical column values (``applier.migrate.spark.canonical``),
  its *key* (primary key, else replica identity index, else the whole row:
  duplicates are then counted), a 64+32-bit row hash (``xxhash64`` and
  ``hash`` over NULL-tagged values) and a *key range*: the top 10 bits of the
  key's ``xxhash64``, i.e. 1024 ranges of the key-hash space (the same on both
  sides whatever the target's collation or SQLite's storage);
- job 1: per range, row count and sums of the hash parts, both sides, joined:
  the ranges that differ;
- job 2, only if some differ: the rows of those ranges, grouped by key and
  joined (full outer) on it: every differing key, counted as missing on the
  target, extra on the target, or changed, with the first ``max_keys`` (in
  key order) shown with both sides' values.

Small tables (``BATCH_PAGES``) are compared together, up to ``BATCH_TABLES`` in one job 1 (a Spark job
costs a second or two whatever its size: one per table would cost a schema of many small tables more than
its rows), told apart by their place in the batch, on either path below (those of each path together);
when that job fails, each of its tables is compared alone, so that a failure names its own table. Tables of
at most ``DRIVER_PAGES`` in all, every leaf and TOAST included (what a sync on a local master copies in its driver), are read by
the driver and handed to Spark as Arrow data (``read_here``): a Python process planning each side's scan and Python workers reading it cost more
than their rows.

PostgreSQL target (``compare_on_servers``): when every compared column has the same type on both
sides and the two servers share an encoding, job 1 runs on the servers instead
(``applier.migrate.spark.rangehash``: per range of the md5 of the key's canonical text, the row count
and hash sums, computed by each server over its page ranges, in Spark tasks that see only those sums, or
on a local master in the driver's threads, and Spark starts only once some table needs it: verifying
tables that agree starts no JVM); the driver compares the ranges, and job 2 reads only the rows of the
differing ranges (the filter runs on the servers). Otherwise (a column declared differently on the target, a SQLite target) the rows
are read into Spark as above. Either way: 1024 key ranges, the same report.

A target column that a column list leaves out (it exists on the source) and
that has no default must be NULL, as the copy and the stream leave it: it is
compared with NULL. A column the source generates and does not send (``SourceTable.generated``: sync
creates it generated on a PostgreSQL target and leaves it out of a SQLite one) is compared by its value
wherever the target table holds it, computed there or not, on every path: a target that no longer
computes what the source does differs. A table without columns compares its row counts.

A target table that does not exist differs (``TableResult.target_missing``):
the target lacks what the source publishes.

Exit status of the command (``VerifyReport.status``): 0 only when every table
agrees; 1 when some table differs, whatever else could not be compared (a
difference is a verdict); 2 when none differs and some table could not be
compared (its Spark job failed): ``TableResult.error`` names the cause. The
report's last line names both the differing tables and those not compared.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from applier.admin import check_source, check_target, read_progress, source_connect
from applier.config import Config, ConfigError
from applier.decoder.messages import CLOSED_BY, Keepalive, XLogData, decision_position, kind_of
from applier.engine.runner import Runner
from applier.lsn import LSN
from applier.migrate.spark.copy import spark_error_line
from applier.migrate.spark.session import (
    begin,
    check_spark_target,
    is_local,
    local_threads,
    reraise_interrupt,
    spark_for,
    spark_of,
    task_slots,
)
from applier.migrate.sync import DRIVER_PAGES, TargetDb, count_in_snapshot, read_tables_in_snapshot, slot_row
from applier.source.base import Source, SourceError
from applier.source.walsender import WalSender
from applier.targets.backends import backend_of
from applier.text import quote_ident
from applier.url import Kind

log = logging.getLogger("applier.verify")

KEY_BITS = 10  # 1024 key-hash ranges


class StopBefore:
    """A Source that ends just before the first transaction committed at or after ``point``."""

    def __init__(self, inner: Source, point: LSN) -> None:
        self.inner = inner
        self.point = point
        self.exhausted = False
        self.reached = False  # the stream provably passed every commit before point
        self._block: int | None = None  # the message kind that ends the open transaction / stream block

    def read(self, timeout: float) -> Any:
        """The next frame, or None (for good once the point is reached)."""
        if self.exhausted:
            return None
        frame = self.inner.read(timeout)
        if frame is None:
            return None
        if type(frame) is XLogData:
            kind = kind_of(frame.payload)
            if self._block is None:
                # where the transaction this message opens or ends is decided (None: a message of another kind)
                at = decision_position(frame.payload)
                if at is not None and at >= self.point:
                    self.exhausted = self.reached = True
                    return None
                self._block = CLOSED_BY.get(kind) if kind is not None else None
            elif kind == self._block:
                self._block = None
            return frame
        if isinstance(frame, Keepalive) and frame.wal_end >= self.point and self._block is None:
            self.exhausted = self.reached = True
            return None
        return frame

    def confirm(self, lsn: LSN) -> None:
        """Pass on."""
        self.inner.confirm(lsn)

    def send_status(self, reply: bool = False) -> None:
        """Pass on (asks the server for a keepalive, which may show that the point is passed)."""
        ask = getattr(self.inner, "send_status", None)
        if ask is not None and not self.exhausted:
            ask(reply)

    def close(self) -> None:
        """Pass on."""
        self.inner.close()


def catch_up_to(cfg: Config, point: LSN) -> Any:
    """Apply exactly the transactions committed before ``point`` (see the module header); the Summary."""
    stoppers: list[StopBefore] = []

    def wrap(src: Source) -> Source:
        stoppers.append(StopBefore(src, point))
        return stoppers[-1]

    return Runner(cfg, catchup=True, wrap_source=wrap).run()


# -- report ----------------------------------------------------------------------------------

@dataclass
class TableResult:
    """The comparison of one table."""

    table: str
    target: str
    key: list[str]
    source_rows: int = 0
    target_rows: int = 0
    ranges: int = 0
    differing_ranges: int = 0
    differing_keys: int = 0
    missing_on_target: int = 0
    extra_on_target: int = 0
    changed: int = 0
    first: list[dict[str, Any]] = field(default_factory=list)
    target_missing: bool = False  # the target table does not exist: differs (nothing else here means anything)
    error: str | None = None  # could not compare: why (then nothing else here means anything)

    @property
    def ok(self) -> bool:
        """The two sides agree."""
        return (self.error is None and not self.target_missing and self.differing_ranges == 0
                and self.source_rows == self.target_rows)

    @property
    def differs(self) -> bool:
        """The two sides were compared (or the target table is missing) and do not agree."""
        return self.error is None and not self.ok


@dataclass
class VerifyReport:
    """What ``verify`` found."""

    snapshot_lsn: str
    target_lsn: str
    applied_transactions: int
    tables: list[TableResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every table agrees."""
        return all(t.ok for t in self.tables)

    @property
    def not_compared(self) -> list[TableResult]:
        """The tables that could not be compared."""
        return [t for t in self.tables if t.error is not None]

    @property
    def differing(self) -> list[TableResult]:
        """The tables that differ."""
        return [t for t in self.tables if t.differs]

    @property
    def status(self) -> int:
        """Exit status: 1 some table differs (whatever else could not be compared), else 2 some could not be
        compared, else 0 (every table agrees)."""
        return 1 if self.differing else 2 if self.not_compared else 0

    def as_json(self) -> dict[str, Any]:
        """For --json."""
        return {"ok": self.ok, "status": self.status, "snapshot_lsn": self.snapshot_lsn, "target_lsn": self.target_lsn,
                "applied_transactions": self.applied_transactions,
                "tables": [{**asdict(t), "ok": t.ok} for t in self.tables]}

    def lines(self) -> list[str]:
        """For people: a summary line per table, then the first differing keys."""
        out = [f"source snapshot at {self.snapshot_lsn}; target brought to it (applied {self.applied_transactions} "
               f"transactions; its last applied commit ends at {self.target_lsn})"]
        for t in self.tables:
            name = t.table if t.target in (t.table, t.table.split(".", 1)[-1]) else f"{t.table} -> {t.target}"
            if t.error is not None:
                out.append(f"{name}: could not compare: {t.error}")
                continue
            if t.target_missing:
                out.append(f"{name}: DIFFERENT: target table {t.target} does not exist")
                continue
            if t.ok:
                out.append(f"{name}: OK, {t.source_rows:,} rows, {t.ranges} key ranges agree")
                continue
            out.append(f"{name}: DIFFERENT: source {t.source_rows:,} rows, target {t.target_rows:,} rows; "
                       f"{t.differing_ranges} of {t.ranges} key ranges differ; {t.differing_keys:,} differing keys "
                       f"({t.missing_on_target:,} missing on the target, {t.extra_on_target:,} extra on the target, "
                       f"{t.changed:,} changed)")
            for d in t.first:
                out.append("  " + _describe(d))
        differing, not_compared = self.differing, ", ".join(t.table for t in self.not_compared)
        if differing:
            out.append(f"verify: the source and the target DIFFER in {', '.join(t.table for t in differing)} "
                       f"({len(differing)} of {len(self.tables)} tables)"
                       + (f"; could not compare {not_compared}" if not_compared else ""))
        elif not_compared:
            out.append(f"verify: could not compare {not_compared} (of {len(self.tables)} tables): no verdict")
        else:
            out.append("verify: the source and the target agree")
        return out


def _fmt(v: Any) -> str:
    return "NULL" if v is None else repr(v)


def _describe(d: dict[str, Any]) -> str:
    key = ", ".join(d["key"]) if d["key"] else ""
    kv = f"({key})=({', '.join(_fmt(v) for v in d['key'].values())})" if d["key"] else "(row)"
    src, tgt = d["source"], d["target"]
    if d["kind"] == "missing":
        return f"{kv}: missing on the target; source row {_row(src)}"
    if d["kind"] == "extra":
        return f"{kv}: extra on the target; target row {_row(tgt)}"
    if d["kind"] == "count":
        return f"row {_row(src or tgt)}: {d['source_count']} on the source, {d['target_count']} on the target"
    cols = [c for c in src if src.get(c) != tgt.get(c)]
    return f"{kv}: " + "; ".join(f"{c}: source {_fmt(src.get(c))}, target {_fmt(tgt.get(c))}" for c in cols)


def _row(r: dict[str, Any] | None) -> str:
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in (r or {}).items()) + "}"


# -- the Spark part ----------------------------------------------------------------------------

def tagged_values(ncols: int) -> list[Any]:
    """Columns ``c0``… as compared: NULL as the byte 0, a value as the byte 1 and the value (so that no value
    equals NULL, and an empty value is not one)."""
    from pyspark.sql import functions as F  # start-up time: pyspark

    null, val = F.unhex(F.lit("00")), F.unhex(F.lit("01"))
    return [F.when(F.col(f"c{i}").isNull(), null).otherwise(F.concat(val, F.col(f"c{i}"))) for i in range(ncols)]


def prepared(df: Any, ncols: int, key_idx: list[int], keep: tuple[str, ...] = ()) -> Any:
    """A side's rows (``c0``…) as compared: key range ("bucket"), tagged key, the two row hashes, the values, and the
    columns ``keep`` (not compared: ``applier repair`` keeps each row's place)."""
    from pyspark.sql import functions as F

    names = [f"c{i}" for i in range(ncols)]
    tagged = tagged_values(ncols)
    key = F.array(*[tagged[i] for i in key_idx]) if key_idx else F.array(*tagged)
    row = F.array(*tagged)
    return df.select(F.shiftrightunsigned(F.xxhash64(key), 64 - KEY_BITS).cast("int").alias("bucket"),
                     key.alias("key"), F.xxhash64(row).alias("h"), F.hash(row).alias("m"), *names, *keep)


def hash_sums(F: Any) -> list[Any]:  # noqa: N803 - the usual alias of pyspark.sql.functions
    """Per group: the row count and the sums of the row hashes' parts (``prepared``)."""
    return [F.count(F.lit(1)).alias("n"),
            F.sum(F.col("h").bitwiseAND(F.lit(0xFFFFFFFF))).alias("s1"),
            F.sum(F.shiftrightunsigned(F.col("h"), 32)).alias("s2"),
            F.sum(F.col("m").cast("long").bitwiseAND(F.lit(0xFFFFFFFF))).alias("s3")]


SUMS = ("n", "s1", "s2", "s3")


@dataclass(frozen=True)
class Compared:
    """One table whose rows are read into Spark to be compared (``compare``): its plans and columns."""

    label: str  # the source table, for job descriptions and logs
    source_plan: str
    target_plan: str
    target_format: str
    columns: list[str]
    key: list[str]
    pages: int  # the source table's size, every leaf and TOAST included (``read_here``)

    def sides(self, spark: Any, here: bool = False) -> tuple[Any, Any]:
        """Both sides' rows, ``prepared``; ``here``: read in the driver (``read_tables_here``)."""
        from applier.migrate.spark.source import read_table, read_tables_here  # start-up time: pyspark, pyarrow

        key_idx = [self.columns.index(k) for k in self.key]
        return tuple(prepared(read_tables_here(spark, [(fmt, plan)]).drop("t") if here
                              else read_table(spark, fmt, plan), len(self.columns), key_idx)
                     for fmt, plan in (("applier_pg", self.source_plan), (self.target_format, self.target_plan)))


def read_here(tables: list[Compared]) -> bool:
    """Whether ``tables`` are read in the driver (``read_tables_here``): at most ``DRIVER_PAGES`` of source pages
    in all (every leaf, TOAST included), the size of a table that a sync on a local master copies in its driver (a
    Python process planning each side's scan and the Python workers reading it cost a verify's first job more
    than such tables' rows). The driver holds them whole while Spark takes them: on any master."""
    return sum(t.pages for t in tables) <= DRIVER_PAGES


def placed(spark: Any, tables: list[Compared]) -> tuple[Any, Any]:
    """Both sides' rows of several tables, each side one scan (``read_tables``, or ``read_tables_here``: ``read_here``):
    the table's place ``t`` in ``tables``, its key range, and row hashes as ``prepared`` makes them for the table
    alone (the key, hence the range, is the same; the row hash covers the widest table's columns, the missing ones
    NULL on both sides)."""
    from pyspark.sql import functions as F

    from applier.migrate.spark.source import read_tables, read_tables_here  # start-up time: pyspark, pyarrow

    width = max(len(t.columns) for t in tables)
    tagged = tagged_values(width)
    key = None
    for n, t in enumerate(tables):
        cols = [tagged[t.columns.index(k)] for k in t.key] if t.key else tagged[:len(t.columns)]
        key = (F if key is None else key).when(F.col("t") == n, F.array(*cols))
    assert key is not None  # tables is not empty
    row = F.array(*tagged)
    out = []
    for fmt_plan in ([("applier_pg", t.source_plan) for t in tables],
                     [(t.target_format, t.target_plan) for t in tables]):
        df = read_tables_here(spark, fmt_plan) if read_here(tables) else read_tables(spark, fmt_plan, task_slots(spark))
        out.append(df.select("t", F.shiftrightunsigned(F.xxhash64(key), 64 - KEY_BITS).cast("int").alias("bucket"),
                             F.xxhash64(row).alias("h"), F.hash(row).alias("m")))
    return out[0], out[1]


def compare(spark: Any, tables: list[Compared], kind: Kind, max_keys: int) -> list[TableResult]:
    """Compare tables (see the module header): job 1 of all of them at once (one Spark job, one scan a side, the
    tables told apart by their place in ``tables``: a job per small table would cost more than its rows), then
    job 2 of each that differs. TableResults in the order of ``tables`` (table names left to the caller); a failure
    raises (``_Batch`` then compares each alone)."""
    from pyspark.sql import functions as F

    sc = spark.sparkContext
    names = ", ".join(t.label for t in tables)
    sc.setJobDescription(f"applier verify: {names}")
    log.debug("comparing %d table(s): %s", len(tables), names)
    try:
        # not cached: caching slows down job 1 (the common case: all agree) more than a second read costs job 2
        alone = tables[0].sides(spark, read_here(tables)) if len(tables) == 1 else None  # read again by job 2 if it differs
        rows = ([s.select(F.lit(0).alias("t"), "bucket", "h", "m") for s in alone] if alone is not None
                else list(placed(spark, tables)))

        def side(i: int, p: str) -> Any:
            agg = rows[i].groupBy("t", "bucket").agg(*hash_sums(F))
            return agg.select("t", "bucket", *[F.col(c).alias(f"{p}{c}") for c in SUMS])

        t0 = time.monotonic()
        ranges = side(0, "a_").join(side(1, "b_"), on=["t", "bucket"], how="full_outer").collect()
        log.debug("%s: key ranges compared in %.1fs", names, time.monotonic() - t0)
        results = [TableResult("", "", t.key, ranges=1 << KEY_BITS) for t in tables]
        differing: list[list[int]] = [[] for _ in tables]
        for r in ranges:
            res = results[r["t"]]
            res.source_rows += r["a_n"] or 0
            res.target_rows += r["b_n"] or 0
            if any(r[f"a_{c}"] != r[f"b_{c}"] for c in SUMS):
                differing[r["t"]].append(int(r["bucket"]))
        for t, res, buckets in zip(tables, results, differing, strict=True):
            res.differing_ranges = len(buckets)
            if buckets:
                src, tgt = alone if alone is not None else t.sides(spark, read_here([t]))
                differing_keys(src.where(F.col("bucket").isin(buckets)), tgt.where(F.col("bucket").isin(buckets)),
                               t.columns, t.key, kind, max_keys, res)
                log.debug("%s: differing keys found in %.1fs", t.label, time.monotonic() - t0)
        return results
    finally:
        sc.setJobDescription(None)


def differing_keys(src: Any, tgt: Any, columns: list[str], key: list[str], target_kind: Kind, max_keys: int,
                   res: TableResult) -> None:
    """Job 2 (see the module header) over both sides' rows (``prepared``) of the differing ranges: fills the
    differing keys' counts and the first ``max_keys`` of them into ``res``."""
    from pyspark.sql import functions as F

    from applier.migrate.spark.canonical import display  # start-up time: pyarrow, as pyspark above

    ncols = len(columns)

    def by_key(df: Any, p: str) -> Any:
        agg = df.groupBy("key").agg(
            *hash_sums(F), F.first(F.struct(*[f"c{i}" for i in range(ncols)])).alias("row"))
        return agg.select("key", "row", *[F.col(c) for c in SUMS]).select(
            "key", *[F.col(c).alias(p + c) for c in ("row", *SUMS)])

    joined = by_key(src, "a_").join(by_key(tgt, "b_"), on="key", how="full_outer")
    same = None
    for c in SUMS:
        cond = F.col(f"a_{c}").eqNullSafe(F.col(f"b_{c}"))
        same = cond if same is None else same & cond
    kind = (F.when(F.col("b_n").isNull(), F.lit("missing")).when(F.col("a_n").isNull(), F.lit("extra"))
            .otherwise(F.lit("changed" if key else "count")))
    assert same is not None  # a table without columns is compared by counts, before this
    diff = joined.where(~same).withColumn("kind", kind).persist()
    try:
        counts = {r["kind"]: r["count"] for r in diff.groupBy("kind").count().collect()}
        first = diff.orderBy("key").limit(max_keys).collect() if max_keys > 0 else []
    finally:
        diff.unpersist()
    res.missing_on_target = counts.get("missing", 0)
    res.extra_on_target = counts.get("extra", 0)
    res.changed = counts.get("changed", 0) + counts.get("count", 0)
    res.differing_keys = sum(counts.values())

    def values(row: Any) -> dict[str, Any] | None:
        if row is None:
            return None
        return {c: display(row[f"c{i}"], target_kind) for i, c in enumerate(columns)}

    for r in first:
        a, b = values(r["a_row"]), values(r["b_row"])
        some = a or b or {}
        res.first.append({"kind": r["kind"], "key": {k: some.get(k) for k in key}, "source": a, "target": b,
                          "source_count": r["a_n"] or 0, "target_count": r["b_n"] or 0})


def compare_on_servers(session: Callable[[], Any], tables: list[Compared], kind: Kind, max_keys: int,
                       threads: int = 0) -> list[TableResult]:
    """Compare tables of a target of ``kind`` that keeps the source's types (PostgreSQL) with the per-range sums
    computed on the servers (``applier.migrate.spark.rangehash``), all of them in one Spark job, or with ``threads``
    (a local master) by the driver itself, that many at once; only the rows of the differing ranges are read, by
    job 2 of each table that differs. ``session()`` is Spark, asked for only when a job needs it: with
    ``threads``, when some table differs. TableResults in the order of ``tables``; a failure raises (as
    ``compare``)."""
    # start-up time: pyspark
    from applier.migrate.spark.rangehash import RANGES, bucket_filter, hash_plan, tables_range_sums
    from applier.migrate.spark.source import read_table  # start-up time: pyspark, pyarrow

    plans = [[json.loads(t.source_plan), json.loads(t.target_plan)] for t in tables]
    names = ", ".join(t.label for t in tables)
    described: list[Any] = []  # the SparkContext whose jobs are described, once Spark is asked for

    def spark() -> Any:
        if not described:
            described.append(session().sparkContext)
            described[0].setJobDescription(f"applier verify: {names} (key ranges hashed on the servers)")
        return session()

    try:
        t0 = time.monotonic()
        hashed = [[hash_plan(p, p["columns"], [quote_ident(k) for k in t.key]) for p in pair]
                  for t, pair in zip(tables, plans, strict=True)]
        sums = tables_range_sums(None if threads else spark(), [(a, b) for a, b in hashed], threads)
        log.debug("%s: key ranges compared on the servers in %.1fs", names, time.monotonic() - t0)
        results = []
        for t, pair, (a, b) in zip(tables, plans, sums, strict=True):
            res = TableResult("", "", t.key, ranges=RANGES)
            results.append(res)
            res.source_rows, res.target_rows = sum(v[0] for v in a.values()), sum(v[0] for v in b.values())
            differing = sorted(r for r in a.keys() | b.keys() if a.get(r) != b.get(r))
            res.differing_ranges = len(differing)
            if not differing:
                continue
            key_idx = [t.columns.index(k) for k in t.key]
            sides = []
            for p in pair:  # only the rows of the differing ranges (a table without a key: its row is its key)
                only = bucket_filter([quote_ident(k) for k in t.key] or p["columns"], differing)
                narrowed = json.dumps({**p, "where": f"({p['where']}) AND {only}" if p.get("where") else only})
                sides.append(prepared(read_table(spark(), "applier_pg", narrowed), len(t.columns), key_idx))
            differing_keys(sides[0], sides[1], t.columns, t.key, kind, max_keys, res)
            log.debug("%s: differing keys found in %.1fs", t.label, time.monotonic() - t0)
        return results
    finally:
        for sc in described:
            sc.setJobDescription(None)


# -- the command ---------------------------------------------------------------------------------

BATCH_PAGES = 1024  # a table of at most this many pages (8 MB) is compared in a job with others, one range a side
BATCH_TABLES = 64  # at most this many tables in one job


class _LazySpark:
    """Spark for the comparisons that need it: ``spark`` (a SparkSession, a ``SparkStart`` of one, or None: one
    started for the config's master) once first asked for (``get``); ``begin`` starts a ``SparkStart`` in the
    background ahead of that. A start that failed is ``error``, raised again to every later ask: ``_Batch`` lets it
    through (the command fails as it did when Spark could not start; no table is marked not compared for it, and
    Spark is not started again for each table)."""

    def __init__(self, spark: Any, cfg: Config) -> None:
        self.spark = spark
        self.cfg = cfg
        self.session: Any = None
        self.error: Exception | None = None

    def begin(self) -> None:
        begin(self.spark)

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        if self.session is None:
            try:
                self.session = spark_of(self.spark) if self.spark is not None else spark_for(self.cfg)
            except Exception as exc:
                self.error = exc
                raise
        return self.session


class _Batch:
    """The tables of ``report`` waiting to be compared together (``compare_many``: ``compare`` or
    ``compare_on_servers``), each by its place in the report, whose result fills that place: when comparing
    several together fails, each is compared alone, so that a failure names its own table; a table's failure is
    its result (``TableResult.error``), the others go on. Spark's start failing (``spark``) is not a table's."""

    def __init__(self, report: VerifyReport, compare_many: Callable[[list[Compared]], list[TableResult]],
                 spark: _LazySpark) -> None:
        self.report = report
        self.compare_many = compare_many
        self.spark = spark
        self.waiting: list[tuple[int, Compared]] = []

    def add(self, place: int, table: Compared, small: bool) -> None:
        """Compare ``table`` with the next ones (``small``), or now, alone."""
        if not small:
            self.compare([place], [table])
            return
        self.waiting.append((place, table))
        if len(self.waiting) >= BATCH_TABLES:
            self.flush()

    def flush(self) -> None:
        """Compare the waiting tables."""
        waiting, self.waiting = self.waiting, []
        if waiting:
            self.compare([place for place, _ in waiting], [t for _, t in waiting])

    def compare(self, places: list[int], tables: list[Compared]) -> None:
        """Fill ``places`` of the report with the results of comparing ``tables`` (see the class)."""
        try:
            results = self.compare_many(tables)
        except Exception as exc:  # noqa: BLE001 - one table's failure is reported, the others go on
            reraise_interrupt(exc)
            if exc is self.spark.error:
                raise
            if len(tables) > 1:
                log.debug("comparing %s together failed: each alone", ", ".join(t.label for t in tables))
                for place, table in zip(places, tables, strict=True):
                    self.compare([place], [table])
                return
            held = self.report.tables[places[0]]
            log.debug("comparing %s failed", held.table, exc_info=exc)
            results = [TableResult(held.table, held.target, held.key, error=spark_error_line(exc))]
        for place, res in zip(places, results, strict=True):
            held = self.report.tables[place]
            res.table, res.target = held.table, held.target
            self.report.tables[place] = res


def verify(cfg: Config, *, spark: Any = None, max_keys: int = 10, say: Any = None,
           partitions: int | None = None) -> VerifyReport:
    """Compare every published table at one consistent moment (see the module header). ``spark``: a SparkSession
    or a ``SparkStart`` of one (begun once the checks pass; for a PostgreSQL target on a local master only once a
    table is to be read into Spark; waited for when a comparison first needs it), else one is started then."""
    say = say or (lambda line: None)
    nparts = partitions or cfg.spark["partitions"]
    check_spark_target(cfg)
    check_source(cfg)
    check_target(cfg)

    def slot_idle(when: str) -> None:
        row = slot_row(cfg)
        if row is not None and row[0]:
            raise ConfigError(f"{cfg.where('source', 'slot')}: slot {cfg.source['slot']!r} is in use "
                              f"(pid {row[1]}) {when}; stop `applier run` while verifying")

    slot_idle("now")
    try:
        ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
    except SourceError as exc:
        raise ConfigError(f"{cfg.where('source', 'dsn')}: {exc}") from None
    # a PostgreSQL target on a local master: the driver runs the servers' sums itself, as many at once as the master
    # has threads, and Spark starts only when a table needs it (its rows are compared in Spark: begun then, in the
    # background; some key range differs: started then); verifying tables that agree then starts no JVM
    master = cfg.spark["master"]
    threads = local_threads(master) if is_local(master) and backend_of(cfg).keeps_types else 0
    lazy = _LazySpark(spark, cfg)
    try:
        if not threads:
            lazy.begin()  # a background start of Spark: the checks passed
        from applier.migrate.spark.rangehash import same_types, server_encoding, target_types  # start-up: pyspark
        from applier.migrate.spark.source import pg_plan  # start-up time: pyspark

        temp = f"applier_verify_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        info = ws.create_slot(temp, snapshot="export", temporary=True)
        point = info.consistent_point
        say(f"source snapshot {info.snapshot_name} at {point}; bringing the target to exactly that point")
        summary = catch_up_to(cfg, point)
        applied = read_progress(cfg).lsn
        if applied > point:
            raise ConfigError(f"the target is at {applied}, past the snapshot's {point}: something else applied "
                              f"changes meanwhile; stop `applier run` and verify again")
        report = VerifyReport(str(point), str(applied), summary.transactions)
        tables = read_tables_in_snapshot(cfg, info.snapshot_name)
        target = TargetDb(cfg)
        kind = target.backend.kind
        batch = _Batch(report, lambda items: compare(lazy.get(), items, kind, max_keys), lazy)
        servers = _Batch(report, lambda items: compare_on_servers(lazy.get, items, kind, max_keys, threads), lazy)
        try:
            same_encoding = False  # PostgreSQL on both sides: the key ranges can be hashed on the servers
            if target.backend.keeps_types:
                with source_connect(cfg) as conn:
                    same_encoding = server_encoding(conn) == server_encoding(target.conn)
            for t in tables:
                shown, qtarget = target.name_of(t)
                res_name = t.qualified
                if not target.exists(t):
                    report.tables.append(TableResult(res_name, shown, t.key_columns, target_missing=True))
                    continue
                # the published columns, and the generated ones the source does not send that the target holds
                held = target.column_names(t)
                compared = t.columns + [c for c in t.generated if c.name in held]
                cols = [c.name for c in compared]
                if not compared:  # nothing but a row count (only a PostgreSQL target can hold such a table)
                    say(f"comparing {t.qualified} (no columns: row counts)")
                    n, m = count_in_snapshot(cfg, info.snapshot_name, t), target.count(t)
                    report.tables.append(TableResult(res_name, shown, [], n, m, 1, int(n != m)))
                    continue
                # a column the column lists leave out holds what the copy and the stream leave in it: NULL
                nulls = [c for c in target.columns_without_default(t) if c in t.unpublished]
                qcols = [quote_ident(c) for c in cols]
                mapped = not target.backend.keeps_types  # compared as the kind's mapping of the source's values
                small = t.pages <= BATCH_PAGES  # read whole (one range a side), compared with other small ones
                parts = 1 if small else nparts
                src_plan = pg_plan(cfg.source["dsn"], t.qname, qcols + ["NULL"] * len(nulls), pages=t.pages,
                                   partitions=parts, snapshot=info.snapshot_name, where=t.rowfilter,
                                   app="applier-verify source", only=t.only,
                                   canonical_types=[c.type_oid for c in compared] + [25] * len(nulls)
                                   if mapped else None)
                qcols += [quote_ident(c) for c in nulls]
                fmt, tgt_plan = target.backend.read_plan(target.conn, target.where, qtarget, qcols, parts)
                say(f"comparing {t.qualified}")
                on_servers = not mapped and same_encoding and same_types(
                    [(c.name, c.type_schema, c.type_name, c.type_mod) for c in compared],
                    target_types(target.conn, qtarget))
                report.tables.append(TableResult(res_name, shown, t.key_columns))
                if not on_servers:
                    lazy.begin()  # its rows are read into Spark: started in the background while others are planned
                (servers if on_servers else batch).add(
                    len(report.tables) - 1, Compared(t.qualified, src_plan, tgt_plan, fmt, cols + nulls,
                                                     t.key_columns, t.size_pages), small)
            batch.flush()
            servers.flush()
        finally:
            target.close()
        if read_progress(cfg).lsn != applied:
            raise ConfigError("the target's applied position moved during verification (is `applier run` "
                              "running?); the comparison is not valid, verify again with it stopped")
        slot_idle("after the comparison")
        return report
    finally:
        ws.close()
