"""A sync run again when a partitioned table that is not published references a published one (issue 24, item 4).

What a user relies on: ``fk`` (partitioned, not published) references ``pk``; its leaf ``fk1`` is published.
Emptying ``pk`` for a copy is safe when the only rows ``fk`` holds are those of leaves being emptied anyway,
so a sync that failed part-way is restarted and ``--force`` copies everything again; a leaf that is not
published and holds rows (``fk2``) still makes sync refuse, naming the table, its partition and the foreign
key, with nothing emptied.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from applier.migrate.spark.verify import verify
from applier.migrate.sync import SyncError, sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

SCHEMA = """
CREATE TABLE pk (a int PRIMARY KEY);
CREATE TABLE fk (a int REFERENCES pk) PARTITION BY RANGE (a);
CREATE TABLE fk1 PARTITION OF fk FOR VALUES FROM (0) TO (1000);
CREATE TABLE fk2 PARTITION OF fk FOR VALUES FROM (1000) TO (2000);
"""


def test_a_failed_sync_is_rerun_and_forced_past_a_partitioned_table_that_references_it(
        spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SCHEMA + "INSERT INTO pk SELECT generate_series(1, 100); "
                        "INSERT INTO fk SELECT generate_series(1, 100); CREATE PUBLICATION pub FOR TABLE pk, fk1",
                        src.dbname)
    dst.cluster.execute(SCHEMA + "ALTER TABLE fk1 ADD CONSTRAINT small CHECK (a <= 50)", dst.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    with pytest.raises(SyncError, match=r"1 of 2 tables could not be copied"):
        sync(cfg, spark=spark)
    assert dst.cluster.execute("SELECT (SELECT count(*) FROM pk), (SELECT count(*) FROM fk)", dst.dbname) == [(100, 0)]

    dst.cluster.execute("ALTER TABLE fk1 DROP CONSTRAINT small", dst.dbname)
    said: list[str] = []
    assert sync(cfg, spark=spark, say=said.append).mode == "restart"
    assert any(s.startswith("restarting the interrupted sync") for s in said), said
    src.cluster.execute("INSERT INTO pk VALUES (101); INSERT INTO fk VALUES (101)", src.dbname)
    res = sync(cfg, spark=spark, force=True)
    assert (res.mode, sorted((t.table, t.rows) for t in res.tables)) == ("force", [("public.fk1", 101),
                                                                                    ("public.pk", 101)])
    assert verify(cfg, spark=spark).ok

    # a leaf that is not published holds a row referring to pk: emptying pk would lose what it refers to
    dst.cluster.execute("INSERT INTO pk VALUES (1500); INSERT INTO fk VALUES (1500)", dst.dbname)
    with pytest.raises(SyncError) as err:
        sync(cfg, spark=spark, force=True)
    assert str(err.value) == ("cannot empty target table pk for the copy: target table fk, which is not published, "
                              "references it (foreign key fk_a_fkey) and holds rows (in its partition fk2); empty fk "
                              "or drop fk_a_fkey, then run `applier sync` again")
    assert dst.cluster.execute("SELECT (SELECT count(*) FROM pk), (SELECT count(*) FROM fk)", dst.dbname) \
        == [(102, 102)]
