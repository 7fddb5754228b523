"""The COPY format of a PostgreSQL target: binary where it is safe across the two servers, text where not.

What a user relies on: every table arrives with exactly the source's values. Binary COPY is used for
tables whose columns are all of built-in types (the same on the target); a column of a user type (an
enum, an array of enums, a composite, a domain) or of a type whose binary value is a catalog OID
(``regclass``, ``regtype``) makes the table go in text. In binary a ``regclass`` is the source's OID of
the relation, which names another relation or none on the target; arrays and composites of user types
carry their source OIDs, which servers without PostgreSQL's later leniency reject (the target's types
are made after a few others here, so that their OIDs do differ).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from applier.migrate.sync import sync
from applier.sandbox.clusters import find_install
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

TYPES = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TYPE pair AS (a integer, b text);
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
"""
TABLES = """
CREATE TABLE plain (id integer PRIMARY KEY, n numeric(12,3), f double precision, r real, ts timestamptz,
    lt timestamp, d date, tm time, iv interval, j jsonb, js json, b bytea, ints integer[], tags text[], u uuid,
    ip inet, flag boolean, t text, c char(3), big bigint, sm smallint);
CREATE TABLE typed (id integer PRIMARY KEY, m mood, ms mood[], p pair, ps pair[], k posint);
CREATE TABLE named (id integer PRIMARY KEY, rel regclass, typ regtype, t text);
"""
ROWS = """
INSERT INTO plain SELECT g, g / 7.0, CASE g % 4 WHEN 0 THEN 'NaN' WHEN 1 THEN '-Infinity' ELSE g / 3.0 END,
    g / 11.0, CASE WHEN g % 9 = 0 THEN 'infinity' ELSE timestamptz '1969-12-31 23:00+05' + g * interval '77 min' END,
    timestamp '2000-02-29 12:00' - g * interval '1 day', date '1999-12-31' + g, time '00:00:01' + g * interval '1 s',
    CASE WHEN g % 2 = 0 THEN interval '-1 day 01:00:00' ELSE g * interval '1 month -3 seconds' END,
    jsonb_build_object('g', g, 'a', jsonb_build_array(1, 'x')), ('{"g": ' || g || ', "sp":  1}')::json,
    CASE WHEN g % 5 = 0 THEN NULL ELSE decode(md5(g::text), 'hex') || '\\000\\\\'::bytea END,
    ARRAY[g, NULL, -g], ARRAY['a,b', E'tab\\there', '"q"', NULL], md5(g::text)::uuid, ('10.0.' || g % 256 || '.1/24')::inet,
    g % 2 = 0, CASE WHEN g % 7 = 0 THEN NULL WHEN g % 7 = 1 THEN '' ELSE E'x\\\\y\\nz\\r é ✓ ' || g END, 'ab',
    g::bigint * 1000000007, (g % 30000)::smallint
  FROM generate_series(1, 6000) g;
INSERT INTO typed SELECT g, (ARRAY['sad', 'ok', 'happy']::mood[])[g % 3 + 1], ARRAY['ok', NULL, 'sad']::mood[],
    ROW(g, 'p' || g)::pair, ARRAY[ROW(g, NULL)::pair, ROW(NULL, 'x,y')::pair], g
  FROM generate_series(1, 6000) g;
INSERT INTO named SELECT g, (ARRAY['plain', 'typed', 'named'])[g % 3 + 1]::regclass,
    (ARRAY['mood', 'pair', 'integer'])[g % 3 + 1]::regtype, 'n' || g
  FROM generate_series(1, 6000) g;
CREATE PUBLICATION pub FOR TABLE plain, typed, named;
"""


def _rows(db: ScratchDb, table: str) -> list[tuple]:
    return db.cluster.execute(f"SELECT row_::text FROM {table} row_ ORDER BY id", db.dbname)


def test_binary_where_safe_text_where_not_with_equal_contents(spark, src: ScratchDb, dst: ScratchDb,
                                                              tmp_path: Path) -> None:
    src.cluster.execute(TYPES + TABLES + ROWS, src.dbname)
    # the target's types get other OIDs than the source's: a few types are made before them
    dst.cluster.execute("CREATE TYPE shift1 AS ENUM ('x'); CREATE TYPE shift2 AS (x int); CREATE DOMAIN shift3 AS int; "
                        + TYPES + TABLES, dst.dbname)
    res = sync(make_config(src, dst.url, tmp_path / "work", partitions=2), spark=spark)
    assert {t.table: (t.copy_format, t.rows) for t in res.tables} == {
        "public.plain": ("binary", 6000), "public.typed": ("text", 6000), "public.named": ("text", 6000)}
    assert max(t.partitions for t in res.tables) == 2
    for table in ("plain", "typed", "named"):
        want = _rows(src, table)
        assert len(want) == 6000
        assert _rows(dst, table) == want, table


@pytest.mark.parametrize("older", ["source", "target"], ids=["15-to-newest", "newest-to-15"])
def test_binary_across_versions(spark, pg_clusters: ClusterPool, src: ScratchDb, dst: ScratchDb, older: str,
                                tmp_path: Path) -> None:
    """PostgreSQL 15 to the newest, and the newest into 15 (a newer sender, an older receiver): built-in types go
    in binary, and arrive equal."""
    try:
        old = pg_clusters.get(find_install(15), older)
    except Exception as exc:  # noqa: BLE001 - no PostgreSQL 15 on this machine
        pytest.skip(f"no PostgreSQL 15: {exc}")
    with scratch_db(old, f"{older}15") as db15:
        source, target = (db15, dst) if older == "source" else (src, db15)
        source.cluster.execute(TYPES + TABLES + ROWS, source.dbname)
        target.cluster.execute(TYPES + TABLES, target.dbname)
        res = sync(make_config(source, target.url, tmp_path / "work", partitions=2), spark=spark)
        assert {t.table: t.copy_format for t in res.tables}["public.plain"] == "binary"
        for table in ("plain", "typed", "named"):
            assert _rows(target, table) == _rows(source, table), table
