"""Target tables made from the source's catalog (``applier.migrate.schema``), without Spark.

What a user relies on: on PostgreSQL the created table has the source's column
types, NOT NULL, constant defaults and ``nextval`` of its sequences (not
``now()``), primary key and replica identity index (built once the copy is
over, the table marked until then); only published columns
(column lists) are created and row filters are read; on SQLite the declared
types follow the engine's mapping. On PostgreSQL (15 and 18) the user-defined
types, sequences, identity and generated columns are created with the source's
definitions; a type the target defines otherwise, or one that cannot be created,
is reported by name and nothing is created.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest

from applier.migrate.schema import SchemaError, read_source_tables
from applier.progress.migrate import migrate
from applier.targets.postgres.schema import KEYS_OWED, build_pg_keys, prepare_pg_tables
from applier.targets.sqlite.schema import prepare_sqlite_tables
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
    migrate(dst.url)  # the control tables, as sync makes them first
    with psycopg.connect(src.dsn, autocommit=True) as conn:
        tables = read_source_tables(conn, ["pub"])
    assert [t.qualified for t in tables] == ["app.byindex", "app.items"]
    byindex, items = tables
    assert byindex.rowfilter == "(v > (0)::double precision)" and items.rowfilter is None
    assert byindex.key_columns == ["k2", "k1"] and items.key_columns == ["id"]
    assert "secret" not in [c.name for c in items.columns]
    with psycopg.connect(dst.dsn, autocommit=True) as conn, psycopg.connect(src.dsn, autocommit=True) as source:
        done = prepare_pg_tables(conn, tables, {}, source)
        assert done.created == ["app.byindex", "app.items"]
        assert prepare_pg_tables(conn, tables, {}, source).existing == ["app.byindex", "app.items"]  # checked, fine
        owed = f"SELECT table_name FROM {KEYS_OWED} WHERE table_oid = %s::regclass::oid"
        # a row of a table gone (its oid free for another) is deleted when tables are next created
        dst.cluster.execute(f"INSERT INTO {KEYS_OWED} VALUES (1, 'app.gone')", dst.dbname)
        assert prepare_pg_tables(conn, tables, {}, source).existing == ["app.byindex", "app.items"]
        assert dst.cluster.execute(f"SELECT * FROM {KEYS_OWED} WHERE table_name = 'app.gone'", dst.dbname) == []
        # a row whose oid is the table's but not its name (a restore, a wrap) is not the table's: nothing built
        items = next(t for t in tables if t.qualified == "app.items")
        dst.cluster.execute(f"UPDATE {KEYS_OWED} SET table_name = 'app.other' WHERE table_name = 'app.items'",
                            dst.dbname)
        assert not build_pg_keys(conn, items, items.schema, items.name)
        assert dst.cluster.execute(INDEXES, dst.dbname, ["app.items"]) == []
        dst.cluster.execute(f"UPDATE {KEYS_OWED} SET table_name = 'app.items' WHERE table_name = 'app.other'",
                            dst.dbname)
        for t in tables:  # no keys before the copy, and owed so: then built once, no longer owed
            assert dst.cluster.execute(INDEXES, dst.dbname, [t.qualified]) == []
            assert dst.cluster.execute(owed, dst.dbname, [t.qualified]) == [(t.qualified,)]
            # a user's comment (or anything short of a drop) does not lose what the table owes (it did, as a mark)
            dst.cluster.execute(f"COMMENT ON TABLE {t.qualified} IS 'mine'", dst.dbname)
            assert build_pg_keys(conn, t, t.schema, t.name)
            assert not build_pg_keys(conn, t, t.schema, t.name)
            assert dst.cluster.execute(owed, dst.dbname, [t.qualified]) == []
            assert dst.cluster.execute("SELECT obj_description(%s::regclass, 'pg_class')", dst.dbname,
                                       [t.qualified]) == [("mine",)]
    for table in ("app.items", "app.byindex"):
        want = src.cluster.execute(DESCRIBE, src.dbname, [table])
        got = dst.cluster.execute(DESCRIBE, dst.dbname, [table])
        want = [row for row in want if row[0] != "secret"]
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


TYPED = """
CREATE SCHEMA app;
CREATE TYPE app.mood AS ENUM ('sad', 'ok', 'happy', 'it''s');
CREATE DOMAIN app.qty AS integer NOT NULL DEFAULT 1 CHECK (VALUE > 0) CONSTRAINT qty_small CHECK (VALUE < 1000);
CREATE DOMAIN public.code AS varchar(8) COLLATE "C" CHECK (VALUE ~ '^[A-Z]+$');
CREATE TYPE app.spot AS (x double precision, y numeric(6,2), m app.mood);
CREATE TYPE app.span AS RANGE (subtype = float8, subtype_diff = float8mi);
CREATE SEQUENCE app.tickets AS integer START 500 INCREMENT 5 MAXVALUE 100000 CACHE 2;
CREATE TABLE app.things (
    id serial PRIMARY KEY,
    serial_no bigint GENERATED ALWAYS AS IDENTITY (START WITH 10 INCREMENT BY 3 MAXVALUE 90000 CACHE 4 CYCLE),
    rank int GENERATED BY DEFAULT AS IDENTITY,
    ticket int NOT NULL DEFAULT nextval('app.tickets'),
    mood app.mood, moods app.mood[], qty app.qty, code code, spot app.spot, span app.span,
    twice int GENERATED ALWAYS AS (qty * 2) STORED,
    note text);
CREATE PUBLICATION pub FOR TABLE app.things;
INSERT INTO app.things (mood, moods, qty, code, spot, span)
    SELECT 'ok', '{sad,it''s}', g, 'AB', '(1.5,2.25,happy)', app.span(g, g + 1) FROM generate_series(1, 3) g;
"""

TYPES = """
SELECT n.nspname || '.' || t.typname, t.typtype,
  (SELECT array_agg(enumlabel ORDER BY enumsortorder) FROM pg_enum WHERE enumtypid = t.oid)::text,
  format_type(t.typbasetype, t.typtypmod), t.typnotnull, t.typdefault, co.collname,
  (SELECT array_agg(conname || ' ' || pg_get_constraintdef(c.oid) ORDER BY conname) FROM pg_constraint c
   WHERE c.contypid = t.oid AND c.contype = 'c')::text,
  (SELECT array_agg(attname || ' ' || format_type(atttypid, atttypmod) ORDER BY attnum) FROM pg_attribute
   WHERE attrelid = t.typrelid AND attnum > 0)::text,
  (SELECT format_type(rngsubtype, NULL) || ' ' || rngsubdiff::regproc::text || ' '
          || format_type(rngmultitypid, NULL) FROM pg_range WHERE rngtypid = t.oid)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_collation co ON co.oid = t.typcollation
WHERE n.nspname IN ('app', 'public') AND t.typtype IN ('e', 'd', 'c', 'r')
  AND (t.typtype <> 'c' OR (SELECT relkind FROM pg_class WHERE oid = t.typrelid) = 'c')
ORDER BY 1
"""

COLUMNS = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attidentity, a.attgenerated,
       pg_get_expr(d.adbin, d.adrelid)
FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = 'app.things'::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum
"""

SEQUENCES = """
SELECT schemaname, sequencename, data_type::text, start_value, min_value, max_value, increment_by, cycle,
       cache_size, last_value, (SELECT d.refobjid::regclass::text || '.' || d.refobjsubid || d.deptype::text
                                FROM pg_depend d WHERE d.objid = (schemaname || '.' || sequencename)::regclass
                                AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i'))
FROM pg_sequences WHERE NOT starts_with(sequencename, 'applier_') ORDER BY 1, 2
"""  # applier's own control tables' sequences (applier_conflicts.id) are the target's alone


def test_types_sequences_identity_and_generated_columns_are_created_as_on_the_source(
        source_db: ScratchDb, target_db: ScratchDb) -> None:
    migrate(target_db.url)
    source_db.cluster.execute(TYPED, source_db.dbname)
    source_db.cluster.execute("SELECT nextval('app.tickets')", source_db.dbname)
    with psycopg.connect(source_db.dsn, autocommit=True) as source, \
            psycopg.connect(target_db.dsn, autocommit=True) as conn:
        tables = read_source_tables(source, ["pub"])
        assert [c.name for c in tables[0].columns if c.name == "twice"] == []  # generated: created, not copied
        assert prepare_pg_tables(conn, tables, {}, source).created == ["app.things"]
    for sql in (TYPES, COLUMNS, SEQUENCES):
        assert target_db.cluster.execute(sql, target_db.dbname) == source_db.cluster.execute(sql, source_db.dbname)
    # the target's sequences go on where the source's are; identity and generated columns work there
    insert = ("INSERT INTO app.things (mood, qty, code, spot, span) VALUES ('it''s', 4, 'XY', '(0,0,sad)', "
              "'[1,2)') RETURNING id, serial_no, rank, ticket, twice")
    assert target_db.cluster.execute(insert, target_db.dbname) == source_db.cluster.execute(insert, source_db.dbname)


def test_a_type_defined_otherwise_on_the_target_is_named_and_nothing_is_created(
        source_db: ScratchDb, target_db: ScratchDb) -> None:
    migrate(target_db.url)
    source_db.cluster.execute(TYPED, source_db.dbname)
    target_db.cluster.execute("CREATE SCHEMA app; CREATE TYPE app.mood AS ENUM ('sad', 'happy')", target_db.dbname)
    before = target_db.cluster.execute("SELECT count(*) FROM pg_class UNION ALL SELECT count(*) FROM pg_type",
                                       target_db.dbname)
    with psycopg.connect(source_db.dsn, autocommit=True) as source, \
            psycopg.connect(target_db.dsn, autocommit=True) as conn, pytest.raises(SchemaError) as err:
        prepare_pg_tables(conn, read_source_tables(source, ["pub"]), {}, source)
    assert str(err.value).splitlines()[1:] == [
        "  type app.mood exists on the target with another definition: labels: source (sad, ok, happy, it's), "
        "target (sad, happy)"]
    assert target_db.cluster.execute("SELECT count(*) FROM pg_class UNION ALL SELECT count(*) FROM pg_type",
                                     target_db.dbname) == before


def test_a_type_that_cannot_be_created_is_named_by_table_and_column(source_db: ScratchDb,
                                                                   target_db: ScratchDb) -> None:
    migrate(target_db.url)
    source_db.cluster.execute(TYPED.replace("subtype_diff = float8mi", "subtype_diff = public.diff")
                              .replace("CREATE TYPE app.span", "CREATE FUNCTION public.diff(a float8, b float8) "
                                       "RETURNS float8 LANGUAGE internal IMMUTABLE AS 'float8mi';\n"
                                       "CREATE TYPE app.span"), source_db.dbname)
    with psycopg.connect(source_db.dsn, autocommit=True) as source, \
            psycopg.connect(target_db.dsn, autocommit=True) as conn, pytest.raises(SchemaError) as err:
        prepare_pg_tables(conn, read_source_tables(source, ["pub"]), {}, source)
    assert str(err.value).splitlines()[1:] == [
        "  the target lacks what the tables need, and it cannot be created: function public.diff(double precision, "
        "double precision) (a function in language internal; only SQL and PL/pgSQL functions are created) for "
        "app.things column span"]
    assert target_db.cluster.execute("SELECT to_regclass('app.things'), to_regtype('app.mood')",
                                     target_db.dbname) == [(None, None)]


def test_replica_identity_indexes_of_one_name_merged_into_one_schema_get_names_of_their_own(
        source_db: ScratchDb, target_db: ScratchDb) -> None:
    """A table map that puts tables of two source schemas into one target schema: their replica identity indexes,
    of one name on the source (index names are per schema), are both built, the second under the name with a
    number (the build failed after every copy before, the name taken)."""
    source_db.cluster.execute(
        "CREATE SCHEMA east; CREATE SCHEMA west; "
        "CREATE TABLE east.shop (id int PRIMARY KEY, code int NOT NULL); CREATE UNIQUE INDEX shop_code ON east.shop (code); "
        "ALTER TABLE east.shop REPLICA IDENTITY USING INDEX shop_code; "
        "CREATE TABLE west.shop (id int PRIMARY KEY, code int NOT NULL); CREATE UNIQUE INDEX shop_code ON west.shop (code); "
        "ALTER TABLE west.shop REPLICA IDENTITY USING INDEX shop_code; "
        "CREATE PUBLICATION pub FOR TABLE east.shop, west.shop", source_db.dbname)
    migrate(target_db.url)
    table_map = {"east.shop": "public.east_shop", "west.shop": "public.west_shop"}
    with psycopg.connect(source_db.dsn, autocommit=True) as source, \
            psycopg.connect(target_db.dsn, autocommit=True) as conn:
        tables = read_source_tables(source, ["pub"])
        assert prepare_pg_tables(conn, tables, table_map, source).created == ["public.east_shop", "public.west_shop"]
        for t in tables:
            assert build_pg_keys(conn, t, "public", f"{t.schema}_shop")
    assert target_db.cluster.execute(
        "SELECT c.relname, i.relname FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid "
        "JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indisreplident ORDER BY 1", target_db.dbname) == [
        ("east_shop", "shop_code"), ("west_shop", "shop_code1")]


def test_names_with_a_backslash_are_created_where_strings_are_not_standard_conforming(
        source_db: ScratchDb, target_db: ScratchDb) -> None:
    """A table whose name has a backslash, on a target whose database reads ``'…'`` with backslash escapes
    (``standard_conforming_strings = off``): its sequence default and its row in ``applier_keys_owed`` name it as it
    is (both are '…'::regclass literals), and its keys are built."""
    source_db.cluster.execute('CREATE TABLE "sh\\op" (id serial PRIMARY KEY, v text); '
                              'CREATE PUBLICATION pub FOR TABLE "sh\\op"', source_db.dbname)
    target_db.cluster.execute(f"ALTER DATABASE {target_db.dbname} SET standard_conforming_strings = off",
                              target_db.dbname)
    migrate(target_db.url)
    with psycopg.connect(source_db.dsn, autocommit=True) as source, \
            psycopg.connect(target_db.dsn, autocommit=True) as conn:
        (table,) = read_source_tables(source, ["pub"])
        assert prepare_pg_tables(conn, [table], {}, source).created == ["public.sh\\op"]
        assert build_pg_keys(conn, table, "public", "sh\\op")
    assert target_db.cluster.execute(
        "SELECT pg_get_serial_sequence($$public.\"sh\\op\"$$, 'id'), "
        "(SELECT indisprimary FROM pg_index WHERE indrelid = $$public.\"sh\\op\"$$::regclass), "
        "(SELECT count(*) FROM applier_keys_owed)", target_db.dbname) == [("public.\"sh\\op_id_seq\"", True, 0)]
