"""The content check of the regression-database test (``tests.spark.table_content``) finds what it must.

Why: that check is what the regression-database test trusts instead of ``verify``; a check that cannot fail
would hide every defect. Here a source and a target differ on purpose, in the ways issue 24 is about (a
generated column's values, a child's rows changed through its parent), and the check must name the tables,
the columns and the rows; equal contents (the same rows inserted in another order) must not differ. On
SQLite the same, through the README's value mapping.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg

from tests.plugins.clusters import ScratchDb
from tests.spark.table_content import differences, published_tables, sqlite_differences

SOURCE = """
CREATE TABLE p (id int PRIMARY KEY, v text);
CREATE TABLE c (extra text) INHERITS (p);
CREATE TABLE g (id int PRIMARY KEY, a int, b int GENERATED ALWAYS AS (a * 2) STORED);
CREATE TABLE same (id int, t timestamptz, f float8, x bytea);
INSERT INTO p VALUES (1, 'p1'), (2, 'p2');
INSERT INTO c VALUES (1, 'c1', 'x1'), (2, 'c2', 'x2');
INSERT INTO g (id, a) VALUES (1, 1), (2, 2);
INSERT INTO same VALUES (1, '2026-01-01 00:00+02', 0.1, '\\x00'), (2, NULL, 1e300, '');
CREATE PUBLICATION pub FOR TABLE p, c, g, same;
"""
TARGET = """
CREATE TABLE p (id int PRIMARY KEY, v text);
CREATE TABLE c (extra text) INHERITS (p);
CREATE TABLE g (id int PRIMARY KEY, a int, b int);
CREATE TABLE same (id int, t timestamptz, f float8, x bytea);
INSERT INTO p VALUES (1, 'p1 updated'), (2, 'p2');
INSERT INTO c VALUES (1, 'p1 updated', 'x1');
INSERT INTO g (id, a, b) VALUES (1, 1, 2), (2, 2, NULL);
SET TimeZone = 'Asia/Tokyo';
INSERT INTO same VALUES (2, NULL, 1e300, ''), (1, '2026-01-01 00:00+02', 0.1, '\\x00');
"""


def test_the_tables_columns_and_rows_that_differ_are_named(src: ScratchDb, dst: ScratchDb) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    dst.cluster.execute(TARGET, dst.dbname)
    with psycopg.connect(src.dsn) as conn:
        tables = published_tables(conn, "pub")
    assert [t.name for t in tables] == ["c", "g", "p", "same"]
    assert next(t for t in tables if t.name == "g").columns == ("id", "a", "b")  # the generated column included

    differ = differences(src.dsn, dst.dsn, tables)
    assert differ == [
        "public.c: 2 rows on the source, 1 on the target; columns that differ: id, v, extra; "
        "only on the source: (1,c1,x1); (2,c2,x2); only on the target: (1,\"p1 updated\",x1)",
        "public.g: 2 rows on the source, 2 on the target; columns that differ: b; only on the source: (2,2,4); "
        "only on the target: (2,2,)",
        "public.p: 2 rows on the source, 2 on the target; columns that differ: v; only on the source: (1,p1); "
        "only on the target: (1,\"p1 updated\")",
    ]


def test_a_sqlite_target_is_compared_through_the_documented_mapping(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute("""
        CREATE TABLE m (id int PRIMARY KEY, ok bool, f float8, t timestamptz, n numeric, x bytea, a int[],
                        g int GENERATED ALWAYS AS (id * 2) STORED);
        INSERT INTO m VALUES (1, true, 0.1, '2026-01-01 00:00+02', 1.50, '\\x00ff', '{1,2}'),
                             (2, NULL, 'NaN', NULL, NULL, '', '{}');
        CREATE PUBLICATION pub FOR TABLE m;""", src.dbname)
    with psycopg.connect(src.dsn) as conn:
        tables = published_tables(conn, "pub")
    path = tmp_path / "replica.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE m (id INTEGER PRIMARY KEY, ok INTEGER, f REAL, t TEXT, n TEXT, x BLOB, a TEXT)")
    db.executemany("INSERT INTO m VALUES (?, ?, ?, ?, ?, ?, ?)",
                   [(2, None, "NaN", None, None, b"", "{}"), (1, 1, 0.1, "2025-12-31 22:00:00+00", "1.50", b"\0\xff", "{1,2}")])
    db.commit()
    assert sqlite_differences(src.dsn, str(path), tables) == []  # the generated column is not held there

    db.execute("UPDATE m SET n = '1.5' WHERE id = 1")
    db.commit()
    db.close()
    assert sqlite_differences(src.dsn, str(path), tables) == [
        "public.m: 2 rows on the source, 2 on the target; columns that differ: n; "
        "only on the source: (1, 1, 0.1, '2025-12-31 22:00:00+00', '1.50', b'\\x00\\xff', '{1,2}'); "
        "only on the target: (1, 1, 0.1, '2025-12-31 22:00:00+00', '1.5', b'\\x00\\xff', '{1,2}')"]
