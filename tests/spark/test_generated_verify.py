"""Generated columns in ``applier sync`` and ``applier verify`` (issue 24, item 2).

What a user relies on: ``verify`` compares every column the target holds, a column the source generates
(and does not send) by its value, on both of its paths for a PostgreSQL target (key ranges hashed on the
servers; rows read into Spark when a column is declared otherwise) and on a SQLite target; so a generated
column that no longer computes what the source's does (its expression dropped, then left NULL or stale by
the stream, or changed by hand) is a difference naming table, key and column. ``sync`` refuses a target
column that is plain where the source's is generated (the stream never sends its values: it would stay
NULL), with one line naming table and column and what to do, before it writes anything.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from applier.engine.runner import Runner
from applier.migrate.schema import SchemaError
from applier.migrate.spark.verify import verify
from applier.migrate.sync import sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config, target_exec

pytest.importorskip("pyspark")

SOURCE = """
CREATE TABLE g (id int PRIMARY KEY, a int, b int GENERATED ALWAYS AS (a * 2) STORED);
CREATE TABLE h (id int PRIMARY KEY, v varchar(20), b int GENERATED ALWAYS AS (id + 1) STORED);
INSERT INTO g (id, a) SELECT x, x FROM generate_series(1, 100) x;
INSERT INTO h (id, v) SELECT x, 'h' || x FROM generate_series(1, 100) x;
CREATE PUBLICATION pub FOR TABLE g, h;
"""


def test_verify_compares_generated_columns_on_a_postgresql_target(
        spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An applier-created target computes g.b and h.b itself; once its expressions are dropped (plain columns
    then: the stream leaves b NULL in a new row and stale in an updated one) or a value is changed, verify
    names them, for g on the servers and for h (v declared otherwise: its rows read into Spark)."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    assert sync(cfg, spark=spark).rows == 200
    assert target_exec(dst.url, "SELECT attrelid::regclass::text, attgenerated::text FROM pg_attribute "
                                "WHERE attname = 'b' AND attrelid IN ('g'::regclass, 'h'::regclass) ORDER BY 1") \
        == [("g", "s"), ("h", "s")]
    dst.cluster.execute("ALTER TABLE h ALTER COLUMN v TYPE text", dst.dbname)
    assert verify(cfg, spark=spark).ok

    dst.cluster.execute("ALTER TABLE g ALTER COLUMN b DROP EXPRESSION; ALTER TABLE h ALTER COLUMN b DROP EXPRESSION; "
                        "UPDATE h SET b = 0 WHERE id = 5", dst.dbname)
    src.cluster.execute("INSERT INTO g (id, a) VALUES (101, 5); UPDATE g SET a = a + 1 WHERE id = 3", src.dbname)
    Runner(cfg, catchup=True).run()
    caplog.set_level(logging.DEBUG, logger="applier.verify")
    report = verify(cfg, spark=spark)
    lines = report.lines()
    assert not report.ok and report.status == 1, lines
    g, h = report.tables
    assert (g.table, g.source_rows, g.target_rows, g.changed, g.differing_keys) == ("public.g", 101, 101, 2, 2), lines
    assert (h.table, h.changed, h.differing_keys) == ("public.h", 1, 1), lines
    assert "  (id)=('3'): b: source '8', target '6'" in lines, lines
    assert "  (id)=('101'): b: source '10', target NULL" in lines, lines
    assert "  (id)=('5'): b: source '6', target '0'" in lines, lines
    assert lines[-1] == "verify: the source and the target DIFFER in public.g, public.h (2 of 2 tables)"
    on_servers = [r.getMessage() for r in caplog.records if "compared on the servers" in r.getMessage()]
    in_spark = [r.getMessage() for r in caplog.records if r.getMessage().startswith("public.h: key ranges compared")]
    assert [m.split(":")[0] for m in on_servers] == ["public.g"] and in_spark, caplog.text


SQLITE_TARGET = """
CREATE TABLE g (id INTEGER PRIMARY KEY, a INTEGER, k INTEGER NOT NULL DEFAULT 2,
    b INTEGER GENERATED ALWAYS AS (a * k) VIRTUAL)
"""


def test_verify_compares_a_generated_column_on_a_sqlite_target(spark, src: ScratchDb, tmp_path: Path) -> None:
    """sync leaves a generated column the source does not send out of a SQLite table it creates (SQLite cannot
    run PostgreSQL's expression); one made there by hand is compared by its value: a local change of what it
    computes from (k, a column of the target's own) is a difference."""
    src.cluster.execute(SOURCE, src.dbname)
    url = f"sqlite:///{tmp_path / 'replica.db'}"
    target_exec(url, SQLITE_TARGET)
    cfg = make_config(src, url, tmp_path / "work")
    assert sync(cfg, spark=spark).rows == 200
    assert [r[1] for r in target_exec(url, "PRAGMA table_xinfo(h)")] == ["id", "v"]  # created by sync: b left out
    src.cluster.execute("INSERT INTO g (id, a) VALUES (101, 5); UPDATE g SET a = a + 1 WHERE id = 3", src.dbname)
    assert verify(cfg, spark=spark).ok

    target_exec(url, "UPDATE g SET k = 3 WHERE id = 7")
    report = verify(cfg, spark=spark)
    lines = report.lines()
    assert report.status == 1 and [t.differing_keys for t in report.tables] == [1, 0], lines
    assert "  (id)=(7): b: source 14, target 21" in lines, lines


@pytest.mark.parametrize("target", ["postgresql", "sqlite"])
def test_sync_refuses_a_plain_target_column_the_source_generates(
        spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path, target: str) -> None:
    """The issue's reproduction: a target g whose b is a plain column would keep b NULL (the stream does not send
    it) while verify agreed; sync refuses it before writing anything, naming table, column and what to do."""
    src.cluster.execute(SOURCE, src.dbname)
    url = f"sqlite:///{tmp_path / 'replica.db'}" if target == "sqlite" else dst.url
    target_exec(url, "CREATE TABLE g (id int PRIMARY KEY, a int, b int)")
    cfg = make_config(src, url, tmp_path / "work")
    with pytest.raises(SchemaError) as err:
        sync(cfg, spark=spark)
    assert str(err.value).splitlines()[1:] == [
        f"  target table {'g' if target == 'sqlite' else 'public.g'} (source public.g), column b: generated on the "
        "source as (a * 2), a plain column on the target: the source does not send its values, so it would stay "
        "NULL; make it a generated column on the target or drop it"]
    assert target_exec(url, "SELECT count(*) FROM g") == [(0,)]
    assert src.cluster.execute("SELECT count(*) FROM pg_replication_slots", src.dbname) == [(0,)]
