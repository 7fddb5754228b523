"""``applier sync`` to PostgreSQL with user-defined types, sequences, identity and generated columns, then the
stream (PostgreSQL 15 and 18).

What a user relies on: sync creates the enums, domains, composite and range types, the sequences (serial,
identity, a standalone one a default calls) and the table with its identity and generated columns, copies the
rows (the generated column computed on the target, the identity values kept), and ``catchup`` then applies
inserts (identity values from the source, also into a GENERATED ALWAYS column), updates (the generated column
follows) and deletes: the target's rows equal the source's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from applier.engine.runner import Runner
from applier.migrate.spark.verify import verify
from applier.migrate.sync import sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config, target_exec
from tests.spark.test_schema import COLUMNS, SEQUENCES, TYPED, TYPES

pytest.importorskip("pyspark")

ROWS = ("SELECT id, serial_no, rank, ticket, mood, moods, qty, code, spot, span, twice, note FROM app.things "
        "ORDER BY id")

WRITES = """
INSERT INTO app.things (mood, moods, qty, code, spot, span, note)
    SELECT 'happy', '{ok}', g, 'CD', '(3,4.5,ok)', app.span(g, g * 2), 'new ' || g FROM generate_series(10, 30) g;
UPDATE app.things SET qty = qty + 100, mood = 'sad' WHERE id % 3 = 0;
UPDATE app.things SET note = 'touched' WHERE id % 4 = 0;
DELETE FROM app.things WHERE id = 2;
"""


def test_sync_creates_types_sequences_and_columns_and_the_stream_applies_into_them(
        spark, source_db: ScratchDb, target_db: ScratchDb, tmp_path: Path) -> None:
    source_db.cluster.execute(TYPED, source_db.dbname)
    cfg = make_config(source_db, target_db.url, tmp_path / "work")
    res = sync(cfg, spark=spark)
    assert res.created == ["app.things"] and res.rows == 3
    for sql in (TYPES, COLUMNS, SEQUENCES, ROWS):
        assert target_db.cluster.execute(sql, target_db.dbname) == source_db.cluster.execute(sql, source_db.dbname)

    source_db.cluster.execute(WRITES, source_db.dbname)
    Runner(cfg, catchup=True).run()
    rows = target_db.cluster.execute(ROWS, target_db.dbname)
    assert rows == source_db.cluster.execute(ROWS, source_db.dbname)
    assert len(rows) == 23 and all(r[10] == r[6] * 2 for r in rows) and rows[-1][0] == 24


PUBLISHED_GENERATED = """
CREATE TABLE g (id int PRIMARY KEY, a int, twice int GENERATED ALWAYS AS (a * 2) STORED);
CREATE TABLE l (id int PRIMARY KEY, a int, b int, plus int GENERATED ALWAYS AS (a + 1) STORED,
    minus int GENERATED ALWAYS AS (a - 1) STORED);
INSERT INTO g (id, a) SELECT g, g FROM generate_series(1, 50) g;
INSERT INTO l (id, a, b) SELECT g, g, -g FROM generate_series(1, 50) g;
CREATE PUBLICATION pub FOR TABLE g, l (id, a, plus) WITH (publish_generated_columns = stored);
"""
GENERATED_WRITES = """
INSERT INTO g (id, a) SELECT g, g FROM generate_series(51, 60) g;
INSERT INTO l (id, a, b) SELECT g, g, 0 FROM generate_series(51, 60) g;
UPDATE g SET a = a + 100 WHERE id % 3 = 0;
UPDATE l SET a = a + 100 WHERE id % 4 = 0;
DELETE FROM g WHERE id = 7;
DELETE FROM l WHERE id = 8;
"""


def test_generated_columns_an_18_source_publishes_are_copied_and_streamed(
        spark, src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    """PostgreSQL 18 sends the values of published generated columns (publish_generated_columns = stored, or a
    column list naming them): the target takes them as plain columns, from the copy and from the stream."""
    if src.cluster.execute("SELECT current_setting('server_version_num')::int", src.dbname)[0][0] < 180000:
        pytest.skip("publishing generated columns needs PostgreSQL 18")
    src.cluster.execute(PUBLISHED_GENERATED, src.dbname)
    cfg = make_config(src, target_url, tmp_path / "work")
    assert sync(cfg, spark=spark).rows == 100
    src.cluster.execute(GENERATED_WRITES, src.dbname)
    Runner(cfg, catchup=True).run()
    for sql in ("SELECT id, a, twice FROM g ORDER BY id", "SELECT id, a, plus FROM l ORDER BY id"):
        want = src.cluster.execute(sql, src.dbname)
        assert len(want) == 59 and target_exec(target_url, sql) == want, sql
    assert verify(cfg, spark=spark).ok
    if target_url.startswith("sqlite"):
        assert [r[1] for r in target_exec(target_url, "PRAGMA table_info(l)")] == ["id", "a", "plus"]
        return
    # sent: plain columns; not sent (minus): computed by the target from what is
    assert target_exec(target_url, "SELECT attrelid::regclass::text, attname, attgenerated::text FROM pg_attribute "
                                   "WHERE attrelid IN ('g'::regclass, 'l'::regclass) AND attnum > 0 ORDER BY 1, "
                                   "attnum") == [("g", "id", ""), ("g", "a", ""), ("g", "twice", ""),
                                                 ("l", "id", ""), ("l", "a", ""), ("l", "plus", ""),
                                                 ("l", "minus", "s")]
    assert target_exec(target_url, "SELECT count(*) FROM l WHERE minus <> a - 1") == [(0,)]
