"""Sync and verify on the shapes real schemas have: inheritance, partitions, column lists, row filters,
tables without columns, foreign keys from unpublished tables, a table the target rejects.

What a user relies on: the copy holds exactly what the publication publishes (a parent's own rows, not
its children's; partitions as ``publish_via_partition_root`` says); verify finds every way a target can
differ from that (children's rows in the parent, rows a row filter leaves out, values in a column a
column list leaves out, partition rows in the wrong partition); a table without columns is copied
where the target can hold one and refused by name where it cannot; emptying the target for a new copy
works, or refuses naming the foreign key; one table that cannot be copied does not stop the others,
and every failure is reported.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from applier.migrate.schema import SchemaError
from applier.migrate.spark.verify import verify
from applier.migrate.sync import SyncError, sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config, target_exec

pytest.importorskip("pyspark")

SHAPES = """
CREATE TABLE parent (id int PRIMARY KEY, v text);
CREATE TABLE child (extra int) INHERITS (parent);
INSERT INTO parent SELECT g, 'p' || g FROM generate_series(1, 4) g;
INSERT INTO child SELECT g, 'c' || g, g FROM generate_series(101, 146) g;
CREATE TABLE filtered (id int PRIMARY KEY, region text);
INSERT INTO filtered SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END FROM generate_series(1, 10) g;
CREATE TABLE listed (id int PRIMARY KEY, v text, secret text);
INSERT INTO listed SELECT g, 'v' || g, 's' || g FROM generate_series(1, 5) g;
CREATE TABLE leafy (id int PRIMARY KEY, v text) PARTITION BY RANGE (id);
CREATE TABLE leafy_1 PARTITION OF leafy FOR VALUES FROM (0) TO (100);
CREATE TABLE leafy_2 PARTITION OF leafy FOR VALUES FROM (100) TO (200);
INSERT INTO leafy SELECT g, 'l' || g FROM generate_series(90, 109) g;
CREATE TABLE rooted (id int PRIMARY KEY, v text) PARTITION BY RANGE (id);
CREATE TABLE rooted_1 PARTITION OF rooted FOR VALUES FROM (0) TO (100);
CREATE TABLE rooted_2 PARTITION OF rooted FOR VALUES FROM (100) TO (200);
INSERT INTO rooted SELECT g, 'r' || g FROM generate_series(95, 104) g;
CREATE TABLE bag (a int, b text);
ALTER TABLE bag REPLICA IDENTITY FULL;
INSERT INTO bag VALUES (1, 'x'), (1, 'x'), (2, 'y');
CREATE PUBLICATION pub FOR TABLE parent, filtered WHERE (region = 'eu'), listed (id, v), leafy, bag;
CREATE PUBLICATION pub_root FOR TABLE rooted WITH (publish_via_partition_root = true);
"""


def _count(url: str, table: str) -> int:
    return target_exec(url, f'SELECT count(*) FROM "{table}"' if url.startswith("sqlite") else
                       f"SELECT count(*) FROM ONLY {table}")[0][0]


def _tables(url: str) -> set[str]:
    if url.startswith("sqlite"):
        return {r[0] for r in target_exec(url, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {r[0] for r in target_exec(url, "SELECT relname::text FROM pg_class WHERE relnamespace = "
                                           "'public'::regnamespace AND relkind IN ('r', 'p')")}


def test_the_copy_holds_what_is_published_and_verify_finds_every_wrong_place(
        spark, src: ScratchDb, target_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="applier.verify")
    src.cluster.execute(SHAPES, src.dbname)
    # a target column the column list leaves out: the copy and the stream leave it NULL
    target_exec(target_url, "CREATE TABLE listed (id integer PRIMARY KEY, v text, secret text)")
    cfg = make_config(src, target_url, tmp_path / "work", partitions=1, **{"source.publications": ["pub", "pub_root"]})
    res = sync(cfg, spark=spark)
    copied = {t.table: t.rows for t in res.tables}
    # the parent's own rows (the child is published as a table of its own); leaves, or the root with its leaves
    assert copied == {"public.parent": 4, "public.child": 46, "public.filtered": 5, "public.listed": 5,
                      "public.leafy_1": 10, "public.leafy_2": 10, "public.rooted": 10, "public.bag": 3}
    assert {t: _count(target_url, t) for t in ("parent", "child", "filtered", "leafy_1", "leafy_2", "rooted")} == \
        {"parent": 4, "child": 46, "filtered": 5, "leafy_1": 10, "leafy_2": 10, "rooted": 10}
    tables = _tables(target_url)
    assert "leafy" not in tables and "rooted_1" not in tables  # not published as such
    assert target_exec(target_url, "SELECT count(*) FROM listed WHERE secret IS NOT NULL")[0][0] == 0
    assert verify(cfg, spark=spark).ok

    # each way a copy could go wrong
    target_exec(target_url, "INSERT INTO parent (id, v) VALUES (101, 'c101')")  # a child's row in the parent
    target_exec(target_url, "INSERT INTO filtered VALUES (1, 'us')")  # a row the row filter leaves out
    target_exec(target_url, "UPDATE listed SET secret = 's' || id WHERE id = 2")  # a column left out has a value
    target_exec(target_url, "DELETE FROM leafy_2 WHERE id = 105")  # a partition's row in another partition
    target_exec(target_url, "INSERT INTO leafy_1 VALUES (105, 'l105')")
    target_exec(target_url, "DELETE FROM rooted WHERE id >= 100")  # the root without its partitions' rows
    one = "rowid = (SELECT min(rowid)" if target_url.startswith("sqlite") else "ctid = (SELECT min(ctid)"
    target_exec(target_url, f"DELETE FROM bag WHERE {one} FROM bag WHERE a = 1)")  # one of two equal rows
    report = verify(cfg, spark=spark)
    by_table = {t.table: t for t in report.tables}
    assert not report.ok
    assert {name for name, t in by_table.items() if not t.ok} == \
        {"public.parent", "public.filtered", "public.listed", "public.leafy_1", "public.leafy_2", "public.rooted",
         "public.bag"}
    assert (by_table["public.parent"].source_rows, by_table["public.parent"].extra_on_target) == (4, 1)
    assert by_table["public.filtered"].extra_on_target == 1
    listed = by_table["public.listed"]
    assert listed.changed == 1
    assert listed.first[0]["source"]["secret"] is None and listed.first[0]["target"]["secret"] == "s2"
    assert (by_table["public.leafy_1"].extra_on_target, by_table["public.leafy_2"].missing_on_target) == (1, 1)
    assert by_table["public.rooted"].missing_on_target == 5
    assert (by_table["public.bag"].changed, by_table["public.bag"].first[0]["kind"]) == (1, "count")
    assert by_table["public.child"].ok
    if target_url.startswith("sqlite"):  # read into Spark: the small tables in one job, one scan a side
        assert "comparing 8 table(s)" in caplog.text and "each alone" not in caplog.text


ROWLESS = """
CREATE TABLE t (id int PRIMARY KEY);
INSERT INTO t VALUES (1), (2);
CREATE TABLE nocols (gone int);
ALTER TABLE nocols DROP COLUMN gone;
INSERT INTO nocols SELECT FROM generate_series(1, 3);
CREATE PUBLICATION pub FOR TABLE t, nocols;
"""


def test_a_table_without_columns_is_copied_to_postgres(spark, src: ScratchDb, dst: ScratchDb,
                                                       tmp_path: Path) -> None:
    src.cluster.execute(ROWLESS, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work", partitions=1)
    res = sync(cfg, spark=spark)
    assert {t.table: t.rows for t in res.tables} == {"public.nocols": 3, "public.t": 2}
    assert dst.cluster.execute("SELECT count(*) FROM nocols", dst.dbname) == [(3,)]
    report = verify(cfg, spark=spark)
    assert report.ok and {t.table: t.source_rows for t in report.tables}["public.nocols"] == 3
    dst.cluster.execute("INSERT INTO nocols DEFAULT VALUES", dst.dbname)
    report = verify(cfg, spark=spark)
    assert [(t.table, t.source_rows, t.target_rows) for t in report.tables if not t.ok] == [("public.nocols", 3, 4)]


def test_a_table_without_columns_is_refused_by_name_on_sqlite(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(ROWLESS, src.dbname)
    cfg = make_config(src, f"sqlite:///{tmp_path / 'replica.db'}", tmp_path / "work")
    with pytest.raises(SchemaError, match=r"source table public\.nocols publishes no columns .*SQLite table needs "
                                          r"one; leave it out of the publication"):
        sync(cfg, spark=None)
    assert src.cluster.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()",
                               src.dbname) == [(0,)]


def test_a_new_copy_empties_tables_that_unpublished_tables_reference(spark, src: ScratchDb, dst: ScratchDb,
                                                                      tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE a (id int PRIMARY KEY); INSERT INTO a VALUES (1), (2), (3); "
                        "CREATE PUBLICATION pub FOR TABLE a", src.dbname)
    dst.cluster.execute("CREATE TABLE a (id integer PRIMARY KEY); "
                        "CREATE TABLE ref (a_id integer REFERENCES a); "  # not published
                        "CREATE TABLE ref2 (r integer, FOREIGN KEY (r) REFERENCES a)", dst.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work", partitions=1)
    sync(cfg, spark=spark)
    dst.cluster.execute("INSERT INTO ref VALUES (2)", dst.dbname)
    with pytest.raises(SyncError, match=r"cannot empty target table a for the copy: target table ref, which is "
                                        r"not published, references it \(foreign key ref_a_id_fkey\) and holds rows"):
        sync(cfg, spark=spark, force=True)
    assert dst.cluster.execute("SELECT count(*) FROM a", dst.dbname) == [(3,)]  # nothing emptied
    dst.cluster.execute("DELETE FROM ref", dst.dbname)
    src.cluster.execute("INSERT INTO a VALUES (4)", src.dbname)
    res = sync(cfg, spark=spark, force=True)  # the empty referencing tables are truncated with it
    assert {t.table: t.rows for t in res.tables} == {"public.a": 4}
    assert verify(cfg, spark=spark).ok


def test_one_table_that_cannot_be_copied_does_not_stop_the_others(spark, src: ScratchDb, target_url: str,
                                                                   tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE a (id int PRIMARY KEY); INSERT INTO a SELECT generate_series(1, 10); "
                        "CREATE TABLE b (id int PRIMARY KEY, n int); INSERT INTO b VALUES (1, 5), (2, 50); "
                        "ALTER TABLE b ADD CHECK (n < 10) NOT VALID; "  # the source let 50 through
                        "CREATE TABLE c (id int PRIMARY KEY, n int); INSERT INTO c VALUES (1, 5), (2, 50); "
                        "CREATE TABLE d (id int PRIMARY KEY); INSERT INTO d SELECT generate_series(1, 7); "
                        "CREATE PUBLICATION pub FOR TABLE a, b, c, d", src.dbname)
    target_exec(target_url, "CREATE TABLE b (id integer PRIMARY KEY, n integer CHECK (n < 10))")
    target_exec(target_url, "CREATE TABLE c (id integer PRIMARY KEY, n integer CHECK (n < 20))")
    cfg = make_config(src, target_url, tmp_path / "work", partitions=1)
    said: list[str] = []
    with pytest.raises(SyncError) as err:
        sync(cfg, spark=spark, say=said.append)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("2 of 4 tables could not be copied")
    assert len(lines) == 3 and "copying public.b failed: " in lines[1] and "copying public.c failed: " in lines[2]
    assert all("check" in line.lower() for line in lines[1:])
    assert (_count(target_url, "a"), _count(target_url, "d")) == (10, 7)  # the others are copied
    assert any("going on with the other tables" in s for s in said)
