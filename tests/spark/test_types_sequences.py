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
from applier.migrate.sync import sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config
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
