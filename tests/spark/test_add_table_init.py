"""`applier sync --table` on a replica that `applier init` made (a target made by pg_dump, no full sync).

What a user relies on: the published tables made on the target as pg_dump would make them (with their rows),
`applier init`, then a table added to the publication with rows while a writer keeps committing: `applier sync
--table` copies it at a snapshot and joins it, and after `catchup` the target equals the source, each row once.
This is what `apply.new_tables = "sync"` runs as a child on such a replica. Refused, one line each: a target that
no `applier init` (nor `applier sync`) made a replica (the slot made by hand), and a full sync that was interrupted.

Without the change (``_need_done_sync`` in ``applier.migrate.add_table``, and `applier init` writing no progress
row) the join is refused with "no sync has run: run `applier sync` first" and the refusals say that too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from applier.migrate.add_table import sync_tables
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config, target_exec
from tests.spark.test_add_table import ROWS, SOURCE, Writer, cli, config_file, equal_soon

pytest.importorskip("pyspark")

# table a as pg_dump --schema-only and a data dump would leave it on either target (n is not published yet)
TARGET_A = ("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL)",
            "INSERT INTO a WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 1000) "
            "SELECT i, 0 FROM g")


def test_added_to_a_replica_made_by_init(spark: Any, src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    for sql in TARGET_A:
        target_exec(target_url, sql)
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
    made = cli("init", "-c", str(cfg_file))
    assert made.returncode == 0, made.stderr
    writer = Writer(src.dsn)
    writer.start()
    try:
        writer.pause(0.5)
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        writer.pause(1.0)  # changes to n in the stream before the copy's snapshot: in the copy too
        said: list[str] = []
        res = sync_tables(make_config(src, target_url, tmp_path / "work"), ["public.n"], spark=spark,
                          say=said.append)
        assert [t.table for t in res.tables] == ["public.n"] and res.tables[0].rows > ROWS
        assert any("joined to the stream" in s for s in said), said
        writer.pause(1.0)  # and after it
    finally:
        writer.stop()
    done = cli("catchup", "-c", str(cfg_file))
    assert done.returncode == 0, done.stderr
    equal_soon(src, target_url, seconds=0)
    assert target_exec(target_url, "SELECT state FROM applier_sync_tables") == [("ready",)]


def test_refused_without_init_or_with_a_sync_interrupted(src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE + "ALTER PUBLICATION pub ADD TABLE n", src.dbname)
    src.cluster.execute("SELECT pg_create_logical_replication_slot('applier', 'pgoutput')", src.dbname)
    for sql in TARGET_A:
        target_exec(dst.url, sql)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")

    def refused() -> str:
        res = cli("sync", "-c", str(cfg_file), "--table", "public.n")
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
        return res.stderr.strip().splitlines()[-1]  # the error's one line (after what was done, e.g. migrations)

    line = refused()  # the slot was made by hand: nothing made this target a replica
    assert "for apply.name 'applier' this target is none yet (no sync has run, and no progress row from " \
           "`applier init`)" in line, line
    assert cli("init", "-c", str(cfg_file)).returncode == 0
    target_exec(dst.url, "INSERT INTO applier_sync (name, state, run, slot, started_at) "
                         "VALUES ('applier', 'copying', 'r1', 'applier', '2026-11-27T00:00:00+00:00')")  # as a kill leaves it
    line = refused()
    assert "for apply.name 'applier' the full sync is copying (interrupted or running)" in line, line
    assert target_exec(dst.url, "SELECT count(*) FROM applier_sync_tables") == [(0,)]
    assert target_exec(dst.url, "SELECT to_regclass('public.n')") == [(None,)]
