"""``applier sync`` and ``sync --table`` with DDL capture installed on the source: the target starts with each copied table's shape at the
copy's position (``applier_ddl_tables``), written with the sync's completion.

What a user relies on: the apply side diffs the first captured DDL after the copy against the shape the copy was
made at, not one from before or after it. A column added right after the slot's snapshot is not in the kept shape
(it comes in the stream); without capture no shape is kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from applier.ddl.shape import TableShape
from applier.migrate.add_table import sync_tables
from applier.migrate.sync import sync
from applier.source import capture
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config, target_exec

pytest.importorskip("pyspark")


def test_sync_keeps_each_tables_shape_at_the_snapshot(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a');"
                        " CREATE PUBLICATION pub FOR TABLE t", src.dbname)
    capture.install(src.dsn)
    url = f"sqlite:///{tmp_path / 'replica.db'}"

    def say(line: str) -> None:
        if "consistent point" in line:  # the slot and its snapshot exist: a DDL after it
            src.cluster.execute("ALTER TABLE t ADD COLUMN late int", src.dbname)

    res = sync(make_config(src, url, tmp_path / "work"), say=say)
    rows = target_exec(url, "SELECT source_oid, schema_name, table_name, shape, lsn FROM applier_ddl_tables")
    (oid,) = src.cluster.execute("SELECT 't'::regclass::oid", src.dbname)[0]
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [(int(oid), "public", "t", str(res.consistent_point))]
    shape = TableShape.from_json(rows[0][3])
    assert [(c.attnum, c.name) for c in shape.columns] == [(1, "id"), (2, "v")] and shape.captured
    assert json.loads(rows[0][3])["primary_key"] == ["id"]


def test_sync_without_capture_keeps_no_shape(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t", src.dbname)
    url = f"sqlite:///{tmp_path / 'replica.db'}"
    sync(make_config(src, url, tmp_path / "work"))
    assert target_exec(url, "SELECT count(*) FROM applier_ddl_tables") == [(0,)]


def test_sync_table_keeps_the_joined_tables_shape_at_its_snapshot(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE n (id int PRIMARY KEY, v text);"
                        " INSERT INTO n VALUES (1, 'a'); CREATE PUBLICATION pub FOR TABLE t", src.dbname)
    capture.install(src.dsn)
    url = f"sqlite:///{tmp_path / 'replica.db'}"
    cfg = make_config(src, url, tmp_path / "work")
    sync(cfg)
    src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)

    def say(line: str) -> None:
        if "temporary slot" in line:  # the copy's snapshot exists: a DDL after it
            src.cluster.execute("ALTER TABLE n ADD COLUMN late int", src.dbname)

    res = sync_tables(cfg, ["public.n"], say=say)
    rows = target_exec(url, "SELECT table_name, shape, lsn FROM applier_ddl_tables ORDER BY table_name")
    assert [r[0] for r in rows] == ["n", "t"] and rows[0][2] == str(res.consistent_point)
    assert [c.name for c in TableShape.from_json(rows[0][1]).columns] == ["id", "v"]
