"""``applier sync`` into an empty PostgreSQL target creates the functions and collations the tables need
(PostgreSQL 15 and 18).

What a user relies on: a domain whose CHECK calls a PL/pgSQL function, a generated column computed by a SQL
function (which takes an enum: the type comes first), and columns, a domain and a composite type with
collations of their own arrive as on the source, in the right order, and the rows are copied equal; the target
then enforces the CHECK, computes the generated column and sorts by the collation as the source does. A
function that cannot be created (C, internal) refuses the sync in one line naming every missing object with
the tables and columns that need it, before anything is created.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from applier.migrate.schema import SchemaError
from applier.migrate.sync import sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

# a libc collation, and a second one of another provider: ICU (nondeterministic) before 17, the builtin provider
# from 17 (the embedded 18 here is built without ICU)
COLLATIONS = """
CREATE SCHEMA app;
CREATE COLLATION app.bytes (provider = libc, locale = 'C');
"""
ICU = "CREATE COLLATION app.nocase (provider = icu, locale = 'und-u-ks-level2', deterministic = false);"
BUILTIN = "CREATE COLLATION app.nocase (provider = builtin, locale = 'C.UTF-8');"

OBJECTS = """
CREATE TYPE app.kind AS ENUM ('plain', 'taxed');
CREATE FUNCTION app.valid_code(c text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN c COLLATE "C" ~ '^[A-Z]{2}[0-9]+$';  -- not app.nocase: no regular expressions on ICU's nondeterministic
END $$;
CREATE FUNCTION app.rate(k app.kind) RETURNS numeric LANGUAGE sql IMMUTABLE AS $$ SELECT CASE k WHEN 'taxed'
    THEN 1.2 ELSE 1 END $$;
CREATE FUNCTION app.gross(k app.kind, net numeric) RETURNS numeric LANGUAGE sql IMMUTABLE
    RETURN round(net * app.rate(k), 2);
CREATE DOMAIN app.code AS text COLLATE app.nocase CHECK (app.valid_code(VALUE));
CREATE TYPE app.label AS (t text COLLATE app.bytes, n int);
CREATE TABLE app.items (id int PRIMARY KEY, code app.code, kind app.kind, net numeric(10,2),
    gross numeric GENERATED ALWAYS AS (app.gross(kind, net)) STORED, name text COLLATE app.bytes, lab app.label);
INSERT INTO app.items (id, code, kind, net, name, lab) SELECT g, 'AB' || g, (ARRAY['plain', 'taxed'])[g % 2 + 1]::app.kind,
    g * 1.25, (ARRAY['b', 'B', 'a', 'A'])[g % 4 + 1], ROW('x' || g, g)::app.label FROM generate_series(1, 40) g;
CREATE PUBLICATION pub FOR TABLE app.items;
"""

ROWS = "SELECT id, code, kind::text, net, gross, name, lab::text FROM app.items ORDER BY id"
SORTED = "SELECT string_agg(DISTINCT name, '' ORDER BY name) FROM app.items"
CATALOG = """
SELECT p.proname, l.lanname, pg_get_function_identity_arguments(p.oid) FROM pg_proc p
JOIN pg_language l ON l.oid = p.prolang WHERE p.pronamespace = 'app'::regnamespace
UNION ALL SELECT c.collname, c.collprovider::text, c.collisdeterministic::text FROM pg_collation c
WHERE c.collnamespace = 'app'::regnamespace ORDER BY 1
"""


def _collations(db: ScratchDb) -> str:
    builtin = db.cluster.execute("SELECT current_setting('server_version_num')::int >= 170000", db.dbname)[0][0]
    return COLLATIONS + (BUILTIN if builtin else ICU)


def test_functions_and_collations_are_created_before_what_uses_them(spark, source_db: ScratchDb,
                                                                   target_db: ScratchDb, tmp_path: Path) -> None:
    source_db.cluster.execute(_collations(source_db) + OBJECTS, source_db.dbname)
    res = sync(make_config(source_db, target_db.url, tmp_path / "work"), spark=spark)
    assert res.created == ["app.items"] and res.rows == 40
    for sql in (ROWS, SORTED, CATALOG):
        assert target_db.cluster.execute(sql, target_db.dbname) == source_db.cluster.execute(sql, source_db.dbname)
    assert target_db.cluster.execute(SORTED, target_db.dbname) == [("ABab",)]  # app.bytes sorts as C
    # the target enforces the domain's CHECK and computes the generated column with the created functions
    with psycopg.connect(target_db.dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO app.items (id, code) VALUES (100, 'lower1')")
        assert conn.execute("INSERT INTO app.items (id, code, kind, net) VALUES (100, 'ZZ1', 'taxed', 10) "
                            "RETURNING gross").fetchone() == (12,)


UNCREATABLE = """
CREATE SCHEMA app;
CREATE FUNCTION app.is_even(integer) RETURNS boolean LANGUAGE c IMMUTABLE STRICT
    AS '$libdir/plpgsql', 'plpgsql_validator';  -- a real C symbol; never called (STRICT, no rows)
CREATE FUNCTION app.twice(integer) RETURNS integer LANGUAGE internal IMMUTABLE STRICT AS 'int4abs';
CREATE FUNCTION app.ok(integer) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT $1 > 0';
CREATE DOMAIN app.even AS integer CHECK (app.is_even(VALUE)) CHECK (app.ok(VALUE));
CREATE TABLE app.t (id int PRIMARY KEY, e app.even, f app.even, a int, b int GENERATED ALWAYS AS (app.twice(a)) STORED);
CREATE PUBLICATION pub FOR TABLE app.t;
"""


def test_what_cannot_be_created_is_refused_in_one_line_before_anything_is_created(
        spark, source_db: ScratchDb, target_db: ScratchDb, tmp_path: Path) -> None:
    source_db.cluster.execute(UNCREATABLE, source_db.dbname)
    with pytest.raises(SchemaError) as err:
        sync(make_config(source_db, target_db.url, tmp_path / "work"), spark=spark)
    assert str(err.value).splitlines()[1:] == [
        "  the target lacks what the tables need, and it cannot be created: "
        "function app.is_even(integer) (a function in language c; only SQL and PL/pgSQL functions are created) "
        "for app.t column e, app.t column f; "
        "function app.twice(integer) (a function in language internal; only SQL and PL/pgSQL functions are created) "
        "for app.t column b"]
    assert target_db.cluster.execute(NOTHING_MADE, target_db.dbname) == [(None, None, 0)]


NOTHING_MADE = ("SELECT to_regnamespace('app'), to_regclass('app.t'), "
                "(SELECT count(*) FROM pg_proc WHERE proname IN ('ok', 'is_even', 'twice'))")
