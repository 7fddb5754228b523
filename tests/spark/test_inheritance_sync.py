"""A target made with ``pg_dump --schema-only`` of a source with inheritance: sync, catchup, sync again.

What a user relies on: changes to a parent (``UPDATE ONLY``, ``DELETE FROM ONLY``, ``TRUNCATE ONLY``) change the
parent's rows on the target and none of its children's, so ``catchup`` and ``verify`` agree; a new copy
(``sync --force``) empties the published tables and not an unpublished child's rows, which are the target's own;
nor do such rows make a first ``sync`` take the parent for a table that holds rows.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from applier.engine.runner import Runner
from applier.migrate.spark.verify import verify
from applier.migrate.sync import sync
from applier.sandbox.clusters import find_install
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

SOURCE = """
CREATE TABLE inh_p (id int PRIMARY KEY, v text);
CREATE TABLE inh_c (extra text) INHERITS (inh_p);
ALTER TABLE inh_c ADD PRIMARY KEY (id);
CREATE TABLE trunc_p (id int PRIMARY KEY, v text);
CREATE TABLE trunc_c (extra text) INHERITS (trunc_p);
ALTER TABLE trunc_c ADD PRIMARY KEY (id);
CREATE TABLE keep_p (id int PRIMARY KEY, v text);
CREATE TABLE keep_c (extra text) INHERITS (keep_p);
INSERT INTO inh_p VALUES (1, 'p1'), (2, 'p2'), (3, 'p3');
INSERT INTO inh_c VALUES (1, 'c1', 'x'), (2, 'c2', 'x'), (4, 'c4', 'x');
INSERT INTO trunc_p VALUES (1, 'p1'), (2, 'p2');
INSERT INTO trunc_c VALUES (1, 'c1', 'x'), (3, 'c3', 'x');
INSERT INTO keep_p VALUES (1, 'p1');
CREATE PUBLICATION pub FOR TABLE inh_p, trunc_p, ONLY keep_p;
"""


def _only(dst: ScratchDb, table: str) -> list[tuple]:
    return dst.cluster.execute(f"SELECT * FROM ONLY {table} ORDER BY 1", dst.dbname)


def test_a_parent_changed_and_copied_again_leaves_its_children_alone(spark, src: ScratchDb, dst: ScratchDb,
                                                                     tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    install = find_install()
    schema = subprocess.run([str(install.bin("pg_dump")), "--schema-only", "--no-publications", "--no-owner",
                             "-d", src.dsn], capture_output=True, text=True, check=True, timeout=60).stdout
    (tmp_path / "schema.sql").write_text(schema)
    subprocess.run([str(install.bin("psql")), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dst.dsn,
                    "-f", str(tmp_path / "schema.sql")], capture_output=True, text=True, check=True, timeout=60)
    # the target's own row in an unpublished child: not a row of the published (empty) parent
    dst.cluster.execute("INSERT INTO keep_c VALUES (7, 'the target''s own', 'x')", dst.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work", partitions=1)
    res = sync(cfg, spark=spark)
    assert {t.table: t.rows for t in res.tables} == {"public.inh_p": 3, "public.inh_c": 3, "public.trunc_p": 2,
                                                      "public.trunc_c": 2, "public.keep_p": 1}

    src.cluster.execute("UPDATE ONLY inh_p SET v = 'p1 updated' WHERE id = 1", src.dbname)
    src.cluster.execute("DELETE FROM ONLY inh_p WHERE id = 2", src.dbname)
    src.cluster.execute("TRUNCATE ONLY trunc_p", src.dbname)
    summary = Runner(cfg, catchup=True).run()
    assert not summary.errors
    assert _only(dst, "inh_p") == [(1, "p1 updated"), (3, "p3")]
    assert _only(dst, "inh_c") == [(1, "c1", "x"), (2, "c2", "x"), (4, "c4", "x")]
    assert _only(dst, "trunc_p") == []
    assert _only(dst, "trunc_c") == [(1, "c1", "x"), (3, "c3", "x")]
    assert verify(cfg, spark=spark).ok

    src.cluster.execute("INSERT INTO keep_p VALUES (2, 'p2')", src.dbname)
    res = sync(cfg, spark=spark, force=True)
    assert {t.table: t.rows for t in res.tables}["public.keep_p"] == 2
    assert _only(dst, "keep_p") == [(1, "p1"), (2, "p2")]
    assert _only(dst, "keep_c") == [(7, "the target's own", "x")]
    assert _only(dst, "inh_c") == [(1, "c1", "x"), (2, "c2", "x"), (4, "c4", "x")]  # copied again, as on the source
