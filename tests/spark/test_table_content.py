"""The content check of the regression-database test (``tests.spark.table_content``) finds what it must.

Why: that check is what the regression-database test trusts instead of ``verify``; a check that cannot fail
would hide every defect. Here a source and a target differ on purpose, in the ways issue 24 is about (a
generated column's values, a child's rows changed through its parent), and the check must name the tables,
the columns and the rows; equal contents (the same rows inserted in another order) must not differ.
"""

from __future__ import annotations

import psycopg

from tests.plugins.clusters import ScratchDb
from tests.spark.table_content import differences, published_tables

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
