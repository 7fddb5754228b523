"""PySpark Python Data Sources that read a table in parallel ranges (or several small ones in one scan).

``applier_pg`` reads a PostgreSQL table (the source, or a PostgreSQL target,
for ``verify``; its partitions' queries and snapshot are also those of the copy
of ``sync``, ``applier.migrate.spark.copy``); ``applier_sqlite`` reads a
SQLite target table for ``verify``. Both take one option, ``plan``: JSON made
by ``pg_plan`` / ``sqlite_plan`` on the driver (the data source's own methods
run in separate Python processes, so everything they need travels in it).

Rows: one column per table column, named ``c0`` … ``cN`` (Spark's case-
insensitive names cannot clash), every column ``binary``. A value is
PostgreSQL's text output (the form pgoutput sends in text mode, so the copy
goes through exactly the conversions the stream goes through), or with
``canonical`` set the canonical form of ``applier.migrate.spark.canonical``.

PostgreSQL reading, per partition (the connection and query of
``applier.migrate.spark.pgread``): a connection with the walsender's output
settings pinned (ISO dates, UTC, ``extra_float_digits = 3``) plus hex bytea and
UTF-8; ``BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY`` and, when the plan
has one, ``SET TRANSACTION SNAPSHOT '<exported snapshot>'`` so that every
partition sees the same snapshot; then ``COPY (SELECT … FROM [ONLY] t WHERE ctid >=
'(lo,0)' AND ctid < '(hi,0)' AND (row filter)) TO STDOUT (FORMAT csv)``, parsed by
pyarrow into record batches. The page ranges split ``[0, pages)``; the last one
is open-ended, so rows in pages added after the plan was made are still read.
A TID range scan (PostgreSQL 14+) reads only its pages. ``only`` reads the
table without its inheritance children (what a publication publishes of a
table; a partitioned table published via its root is read with its
partitions, without ``only``). The connection's
``application_name`` (``<app> p<partition>``) lets the driver follow the copy
in ``pg_stat_progress_copy``.

SQLite reading: ``rowid`` ranges (one range for a WITHOUT ROWID table), a
read-only connection each, values encoded canonically.

``applier_many`` reads several tables in one scan (``verify`` compares small tables together: a Python data
source costs a planning round trip to a Python process per scan, which a schema of many small tables pays more
than for its rows): option ``plans``, JSON of ``[format, plan]`` pairs (``applier_pg`` / ``applier_sqlite`` and
their plans) and ``partitions`` (the tables' ranges are dealt to that many, each read one after the other:
a Spark task costs more than a small table's rows); rows ``t`` (the table's place in ``plans``), then ``c0`` … ``cW`` as above, ``W`` the widest
table's, the columns past a table's own NULL. ``read_table`` / ``read_tables`` load either with their schema
given, so that Spark does not ask a Python process for it; ``read_tables_here`` reads the same rows in the driver
(small tables: no Python process nor worker at all).
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

from applier.migrate.spark.canonical import canonical_rows_batch, sqlite_source_canonicalizer
from applier.migrate.spark.pgread import pg_in_snapshot, range_query

# the plans, made on the driver (re-exported: the copy and verify build them here)
from applier.migrate.spark.plans import MIN_PAGES_PER_PARTITION as MIN_PAGES_PER_PARTITION
from applier.migrate.spark.plans import ctid_ranges as ctid_ranges
from applier.migrate.spark.plans import pg_plan as pg_plan
from applier.migrate.spark.plans import sqlite_plan as sqlite_plan

CHUNK_BYTES = 4 << 20  # COPY data parsed at a time, per partition
SQLITE_BATCH = 10000


def schema_of(ncols: int) -> StructType:
    """The Spark schema: c0 … cN, all binary."""
    return StructType([StructField(f"c{i}", BinaryType(), True) for i in range(ncols)])


def many_schema(width: int) -> StructType:
    """The Spark schema of ``applier_many``: t, then c0 … c(width-1)."""
    return StructType([StructField("t", IntegerType(), True), *schema_of(width).fields])


def read_table(spark: Any, fmt: str, plan: str) -> Any:
    """The DataFrame of one table's ``plan`` read by data source ``fmt`` (``applier_pg``, ``applier_sqlite``)."""
    ncols = len(json.loads(plan)["columns"])
    return spark.read.format(fmt).schema(schema_of(ncols)).option("plan", plan).load()


def _many(plans: list[tuple[str, str]]) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """``(format, plan)`` pairs of several tables with their plans decoded, and the widest table's column count."""
    decoded = [(fmt, json.loads(plan)) for fmt, plan in plans]
    return decoded, max(len(plan["columns"]) for _, plan in decoded)


def read_tables(spark: Any, plans: list[tuple[str, str]], partitions: int) -> Any:
    """The DataFrame of several tables read in one scan (``applier_many``) of ``partitions`` partitions, each
    reading its share of the tables' ranges one after the other: ``(format, plan)`` each."""
    decoded, width = _many(plans)
    return (spark.read.format("applier_many").schema(many_schema(width))
            .option("plans", json.dumps(decoded)).option("partitions", partitions).load())


def read_tables_here(spark: Any, plans: list[tuple[str, str]]) -> Any:
    """The DataFrame ``read_tables`` makes of ``plans`` (the same columns and rows), read here, in the driver, by
    the same reader, and handed to Spark as Arrow data: no Python process plans a scan and no Python worker reads
    one. For a few small tables: a local verify's first job of a 10-row table took 6 s this way against 14-15 s
    through the data source (idle 2-CPU machine, bench/README.md). The rows are held in the driver's memory."""
    decoded, width = _many(plans)
    reader = _ManyReader(decoded, width, 1)
    schema = many_schema(width)
    arrow = pa.schema([pa.field("t", pa.int32()), *(pa.field(f.name, pa.binary()) for f in schema.fields[1:])])
    batches = [batch for part in reader.partitions() for batch in reader.read(part)]
    return spark.createDataFrame(pa.Table.from_batches(batches, schema=arrow), schema)


class RangePartition(InputPartition):
    """One range of a table: (index, low bound or None, high bound or None)."""

    def __init__(self, index: int, lo: int | None, hi: int | None) -> None:
        super().__init__((index, lo, hi))
        self.index, self.lo, self.hi = index, lo, hi


class _RangeReader(DataSourceReader):
    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan

    def partitions(self) -> list[RangePartition]:
        return [RangePartition(i, lo, hi) for i, (lo, hi) in enumerate(self.plan["ranges"])]


class _PgReader(_RangeReader):
    def read(self, partition: RangePartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override] # ours only
        yield from read_pg_range(self.plan, partition.index, partition.lo, partition.hi)


class _SqliteReader(_RangeReader):
    def read(self, partition: RangePartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override] # ours only
        yield from read_sqlite_range(self.plan, partition.lo, partition.hi)


class PgRangeSource(DataSource):
    """``spark.read.format("applier_pg").option("plan", pg_plan(…)).load()``; see the module header."""

    @classmethod
    def name(cls) -> str:
        return "applier_pg"

    def schema(self) -> StructType:
        return schema_of(len(json.loads(self.options["plan"])["columns"]))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _PgReader(json.loads(self.options["plan"]))


class ManyPartition(InputPartition):
    """Ranges of several tables read one after the other: (place, index, low bound or None, high bound or None)
    each."""

    def __init__(self, items: list[tuple[int, int, int | None, int | None]]) -> None:
        super().__init__(items)
        self.items = items


class _ManyReader(DataSourceReader):
    def __init__(self, plans: list[tuple[str, dict[str, Any]]], width: int, partitions: int) -> None:
        self.plans, self.width, self.nparts = plans, width, partitions

    def partitions(self) -> list[ManyPartition]:
        items = [(place, i, lo, hi) for place, (_, plan) in enumerate(self.plans)
                 for i, (lo, hi) in enumerate(plan["ranges"])]
        n = max(1, min(self.nparts, len(items)))
        return [ManyPartition(items[k::n]) for k in range(n)]

    def read(self, partition: ManyPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override] # ours only
        names = ["t", *(f"c{i}" for i in range(self.width))]
        for place, index, lo, hi in partition.items:
            fmt, plan = self.plans[place]
            batches = (read_pg_range(plan, index, lo, hi) if fmt == PgRangeSource.name()
                       else read_sqlite_range(plan, lo, hi))
            for batch in batches:
                n = batch.num_rows
                pad = [pa.nulls(n, pa.binary())] * (self.width - batch.num_columns)
                yield pa.RecordBatch.from_arrays([pa.array([place] * n, pa.int32()), *batch.columns, *pad],
                                                 names=names)


class ManySource(DataSource):
    """``read_tables``: several tables in one scan; see the module header."""

    @classmethod
    def name(cls) -> str:
        return "applier_many"

    def schema(self) -> StructType:
        raise NotImplementedError("applier_many is read with its schema given (read_tables)")

    def reader(self, schema: StructType) -> DataSourceReader:
        return _ManyReader(json.loads(self.options["plans"]), len(schema.fields) - 1, int(self.options["partitions"]))


class SqliteRangeSource(DataSource):
    """``spark.read.format("applier_sqlite").option("plan", sqlite_plan(…)).load()``; see the module header."""

    @classmethod
    def name(cls) -> str:
        return "applier_sqlite"

    def schema(self) -> StructType:
        return schema_of(len(json.loads(self.options["plan"])["columns"]))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _SqliteReader(json.loads(self.options["plan"]))


# -- the readers proper (plain functions: testable without Spark) -------------------------

def read_pg_range(plan: dict[str, Any], index: int, lo: int | None,
                  hi: int | None) -> Generator[pa.RecordBatch, None, None]:
    """Record batches of one partition of a PostgreSQL table (see the module header)."""
    names = [f"c{i}" for i in range(len(plan["columns"]))]
    transform = None
    if plan.get("canonical") is not None:
        transform = sqlite_source_canonicalizer(plan["canonical"])
    with pg_in_snapshot(plan, index) as conn:
        copy_sql = f"COPY ({range_query(plan, lo, hi)}) TO STDOUT WITH (FORMAT csv)"
        with conn.cursor().copy(copy_sql) as cp:
            for batch in csv_batches(copy_chunks(cp), names):
                yield transform(batch) if transform is not None else batch


def copy_chunks(cp: Any) -> Iterator[bytes]:
    """COPY data in pieces of about CHUNK_BYTES, each made of whole rows (libpq returns one row per read)."""
    buf = bytearray()
    for data in cp:  # a memoryview on libpq's buffer: copied at once so that libpq can free it
        buf += data
        if len(buf) >= CHUNK_BYTES:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


_CSV_PARSE = pacsv.ParseOptions(newlines_in_values=True, ignore_empty_lines=False)


def csv_batches(chunks: Iterator[bytes], names: list[str]) -> Iterator[pa.RecordBatch]:
    """Parse PostgreSQL CSV (unquoted empty = NULL, ``""`` = empty string) into binary record batches."""
    convert = pacsv.ConvertOptions(column_types={n: pa.binary() for n in names}, strings_can_be_null=True,
                                   quoted_strings_can_be_null=False, null_values=[""])
    for chunk in chunks:
        ropts = pacsv.ReadOptions(column_names=names, use_threads=False, block_size=len(chunk) + 1)
        table = pacsv.read_csv(io.BytesIO(chunk), read_options=ropts, parse_options=_CSV_PARSE,
                               convert_options=convert)
        yield from table.combine_chunks().to_batches()


def read_sqlite_range(plan: dict[str, Any], lo: int | None, hi: int | None) -> Iterator[pa.RecordBatch]:
    """Canonical record batches of one rowid range of a SQLite table."""
    names = [f"c{i}" for i in range(len(plan["columns"]))]
    conds, params = [], []
    if lo is not None:
        conds.append("rowid >= ?")
        params.append(lo)
    if hi is not None:
        conds.append("rowid < ?")
        params.append(hi)
    q = f"SELECT {', '.join(plan['columns'])} FROM {plan['table']}" + (" WHERE " + " AND ".join(conds) if conds else "")
    conn = sqlite3.connect(Path(plan["path"]).resolve().as_uri() + "?mode=ro", uri=True, timeout=60)
    try:
        cur = conn.execute(q, params)
        while True:
            rows = cur.fetchmany(SQLITE_BATCH)
            if not rows:
                break
            yield canonical_rows_batch(rows, names)
    finally:
        conn.close()
