"""Target tables made from the source's catalog (``applier.migrate.schema``), without Spark.

What a user relies on: on PostgreSQL the created table has the source's column
types, NOT NULL, constant defaults (not ``nextval``/``now()``), primary key and
replica identity index; only published columns (column lists) are created and
row filters are read; on SQLite the declared types follow the engine's mapping.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg

from applier.migrate.schema import prepare_pg_tables, prepare_sqlite_tables, read_source_tables
from tests.plugins.clusters import ScratchDb

SOURCE = """
CREATE SCHEMA app;
CREATE TABLE app.items (
    id bigserial PRIMARY KEY,
    code varchar(12) NOT NULL DEFAULT 'none',
    qty integer NOT NULL DEFAULT 0,
    price numeric(10,2) DEFAULT 1.50,
    added timestamptz NOT NULL DEFAULT now(),
    flags boolean[] DEFAULT '{t,f}',
    label text COLLATE "C",
    note text DEFAULT 'a' || 'b',
    secret text);
CREATE TABLE app.byindex (k1 int NOT NULL, k2 text NOT NULL, v float4);
CREATE UNIQUE INDEX byindex_k ON app.byindex (k2, k1);
ALTER TABLE app.byindex REPLICA IDENTITY USING INDEX byindex_k;
CREATE PUBLICATION pub FOR TABLE app.items (id, code, qty, price, added, flags, label, note),
    app.byindex WHERE (v > 0);
"""

DESCRIBE = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid),
       co.collname
FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
LEFT JOIN pg_collation co ON co.oid = a.attcollation
WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum
"""

INDEXES = """
SELECT i.indisprimary, i.indisreplident, i.indisunique,
       array(SELECT a.attname::text FROM unnest(i.indkey) k(n) JOIN pg_attribute a
             ON a.attrelid = i.indrelid AND a.attnum = k.n)
FROM pg_index i WHERE i.indrelid = %s::regclass ORDER BY 1, 2
"""


def test_postgres_target_tables_copy_the_source_definition(src: ScratchDb, dst: ScratchDb) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    with psycopg.connect(src.dsn, autocommit=True) as conn:
        tables = read_source_tables(conn, ["pub"])
    assert [t.qualified for t in tables] == ["app.byindex", "app.items"]
    byindex, items = tables
    assert byindex.rowfilter == "(v > (0)::double precision)" and items.rowfilter is None
    assert byindex.key_columns == ["k2", "k1"] and items.key_columns == ["id"]
    assert "secret" not in [c.name for c in items.columns]
    with psycopg.connect(dst.dsn, autocommit=True) as conn:
        done = prepare_pg_tables(conn, tables, {})
        assert done.created == ["app.byindex", "app.items"]
        assert prepare_pg_tables(conn, tables, {}).existing == ["app.byindex", "app.items"]  # checked, fine
    for table in ("app.items", "app.byindex"):
        want = src.cluster.execute(DESCRIBE, src.dbname, [table])
        got = dst.cluster.execute(DESCRIBE, dst.dbname, [table])
        want = [row if row[0] != "id" else row[:3] + (None, None) for row in want if row[0] != "secret"]
        want = [row if row[0] not in ("added", "note") else row[:3] + (None, row[4]) for row in want]
        assert got == want
        assert dst.cluster.execute(INDEXES, dst.dbname, [table]) == src.cluster.execute(INDEXES, src.dbname, [table])
    assert dst.cluster.execute("SELECT relreplident FROM pg_class WHERE oid = 'app.byindex'::regclass",
                               dst.dbname) == [("i",)]


def test_sqlite_target_tables_use_the_engine_mapping(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    with psycopg.connect(src.dsn, autocommit=True) as conn:
        tables = read_source_tables(conn, ["pub"])
    db = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    done = prepare_sqlite_tables(db, tables, {"app.byindex": "bi"})
    assert done.created == ["bi", "app.items"]
    cols = {r[1]: (r[2], r[3], r[5]) for r in db.execute('PRAGMA table_info("app.items")')}
    assert cols == {"id": ("INTEGER", 1, 1), "code": ("TEXT", 1, 0), "qty": ("INTEGER", 1, 0),
                    "price": ("TEXT", 0, 0), "added": ("TEXT", 1, 0), "flags": ("TEXT", 0, 0),
                    "label": ("TEXT", 0, 0), "note": ("TEXT", 0, 0)}
    assert [r[1:3] for r in db.execute('PRAGMA index_list("bi")')] == [("bi_replica_identity", 1)]
    assert [r[2] for r in db.execute('PRAGMA index_info("bi_replica_identity")')] == ["k2", "k1"]
