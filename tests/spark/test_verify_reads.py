"""How verify hands small tables' rows to Spark: read in the driver (``read_tables_here``) or by the data source
(``read_tables``), the same rows.

What a user relies on: whichever way a table's rows reach Spark, verify compares the same values (a PostgreSQL
table as text, one canonicalized for a SQLite target, a SQLite table, an empty one, the narrower tables padded
with NULLs, each row tagged with its table's place); the small tables' way involves no Python process or worker,
which is what makes it the cheaper one (a Python data source is planned by one and read by the others).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.clusters import ScratchDb

pytest.importorskip("pyspark")

from applier.migrate.spark.source import pg_plan, read_tables, read_tables_here, sqlite_plan  # noqa: E402


def test_small_tables_read_in_the_driver_are_the_rows_the_data_source_reads(spark: Any, src: ScratchDb,
                                                                              tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE a (id int PRIMARY KEY, v text, n numeric); CREATE TABLE e (id int); "
                        "INSERT INTO a VALUES (1, 'x', 1.50), (2, '', NULL), (3, NULL, -0.0), "
                        "(4, E'two\\nlines, \"quoted\"', 1e20)", src.dbname)
    db = tmp_path / "t.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE s (id INTEGER PRIMARY KEY, b BLOB, r REAL)")
        conn.executemany("INSERT INTO s VALUES (?, ?, ?)", [(1, b"\x00\xff", 0.5), (2, None, None)])
    conn.close()
    plans = [("applier_pg", pg_plan(src.dsn, '"public"."a"', ['"id"', '"v"', '"n"'], pages=1, partitions=1)),
             ("applier_pg", pg_plan(src.dsn, '"public"."a"', ['"id"', '"v"', '"n"'], pages=1, partitions=1,
                                    canonical_types=[23, 25, 1700])),
             ("applier_pg", pg_plan(src.dsn, '"public"."e"', ['"id"'], pages=0, partitions=1)),
             ("applier_sqlite", sqlite_plan(str(db), '"s"', ['"id"', '"b"', '"r"'], [(None, None)]))]

    here = read_tables_here(spark, plans)
    there = read_tables(spark, plans, 2)
    assert here._jdf.schema().json() == there._jdf.schema().json()  # as Spark holds them, not as given
    rows = sorted(tuple(r) for r in here.collect())
    assert rows == sorted(tuple(r) for r in there.collect())
    assert [r[0] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1, 3, 3]
    assert (0, b"4", b'two\nlines, "quoted"', b"100000000000000000000") in rows
    assert (0, b"2", b"", None) in rows and (0, b"3", None, b"0.0") in rows

    def plan_of(df: Any) -> str:
        return str(df._jdf.queryExecution().executedPlan().toString())

    assert "Python" in plan_of(there)  # the data source's scan: the check below can tell
    assert "Python" not in plan_of(here), plan_of(here)
