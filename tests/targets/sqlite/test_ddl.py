"""The SQLite target's DDL writer (``applier.targets.sqlite.ddl``) on a real SQLite file.

Shapes come from a real source (capture installed, ``applier_ddl.describe(oid)`` before and after a DDL there,
``diff``), so the chain capture → diff → writer is what is tested; each change is written to a SQLite target table
holding rows, inside ``begin()``/``commit()``, and the table is then read as a user would (``PRAGMA table_xinfo``,
``index_list``, the rows in order). A few cases need no server (a shape built by hand).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from applier.ddl.changes import (
    AddColumn,
    AlterType,
    Change,
    CreateTable,
    DropColumn,
    DropTable,
    RenameColumn,
    RenameTable,
    SetDefault,
    SetNotNull,
    diff,
)
from applier.ddl.shape import ColumnShape, TableShape
from applier.errors import ApplyError, FinalError
from applier.lsn import LSN
from applier.source import capture
from applier.targets.sqlite.ddl import sqlite_default
from applier.targets.sqlite.target import SqliteTarget
from tests.plugins.clusters import ScratchDb

AT = LSN(0x16B3748)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[SqliteTarget]:
    t = SqliteTarget(f"sqlite:///{tmp_path / 'target.db'}", "test")
    yield t
    t.close()


def q(t: SqliteTarget, sql: str) -> list[tuple[Any, ...]]:
    return t.conn.execute(sql).fetchall()


def columns(t: SqliteTarget, table: str) -> list[tuple[Any, ...]]:
    """(name, declared type, NOT NULL, default, position in the key) of each column."""
    return [(r[1], r[2], r[3], r[4], r[5]) for r in q(t, f"PRAGMA table_xinfo(\"{table}\")")]


def indexes(t: SqliteTarget, table: str) -> dict[str, tuple[bool, list[str]]]:
    """The named indexes of a table: unique, columns."""
    return {r[1]: (bool(r[2]), [c[2] for c in q(t, f"PRAGMA index_info(\"{r[1]}\")")])
            for r in q(t, f"PRAGMA index_list(\"{table}\")") if r[3] == "c"}


def write(t: SqliteTarget, *changes: Change) -> None:
    t.begin()
    try:
        for c in changes:
            t.write_ddl(c, AT)
    except BaseException:
        t.rollback()
        raise
    t.commit(AT)


class Source:
    """A source table ``t`` with capture installed: its shape as capture describes it, before and after DDL."""

    def __init__(self, db: ScratchDb, create: str) -> None:
        self.db = db
        self.sql(create)
        self.sql("CREATE PUBLICATION p FOR ALL TABLES")
        capture.install(db.dsn)
        self.oid = int(self.sql("SELECT 't'::regclass::oid")[0][0])

    def sql(self, query: str) -> list[tuple[Any, ...]]:
        return self.db.cluster.execute(query, self.db.dbname)

    def shape(self) -> TableShape:
        (doc,) = self.sql(f"SELECT applier_ddl.describe({self.oid})::text")[0]
        return TableShape.from_json(json.dumps(json.loads(doc) | {"captured": True}))

    def alter(self, ddl: str) -> list[Change]:
        """The changes ``ddl`` makes, as the engine would get them."""
        before = self.shape()
        self.sql(ddl)
        return diff(before, self.shape())


@pytest.fixture
def src(source_db: ScratchDb) -> Source:
    return Source(source_db, "CREATE TABLE t (id int PRIMARY KEY, name text NOT NULL, score numeric(6,2) DEFAULT 1.5,"
                             " flag boolean DEFAULT true, made timestamptz DEFAULT now(),"
                             " n bigint GENERATED ALWAYS AS IDENTITY)")


def created(t: SqliteTarget, src: Source) -> None:
    """The table created from the source's shape, holding two rows and a target-only column and index."""
    write(t, CreateTable(src.shape()))
    t.conn.execute("ALTER TABLE t ADD COLUMN note TEXT DEFAULT 'target only'")
    t.conn.execute("CREATE INDEX t_note ON t (note)")
    t.conn.execute("INSERT INTO t (id, name, score, flag, n) VALUES (1, 'a', '2.50', 1, 1), (2, 'b', NULL, 0, 2)")
    t.conn.execute("UPDATE t SET note = 'kept' WHERE id = 2")


def test_create_table_maps_types_keeps_constant_defaults_not_null_and_the_key(target: SqliteTarget,
                                                                               src: Source) -> None:
    src.sql("CREATE UNIQUE INDEX t_name ON t (name)")
    src.sql("CREATE INDEX t_lower ON t (lower(name))")
    write(target, CreateTable(src.shape()))
    assert columns(target, "t") == [("id", "INTEGER", 1, None, 1), ("name", "TEXT", 1, None, 0),
                                    ("score", "TEXT", 0, "'1.5'", 0), ("flag", "INTEGER", 0, "1", 0),
                                    ("made", "TEXT", 0, None, 0), ("n", "INTEGER", 1, None, 0)]
    assert indexes(target, "t") == {"t_name": (True, ["name"])}  # the expression index is skipped
    assert target.target_exists(src.shape())
    target.conn.execute("INSERT INTO t (id, name, n) VALUES (1, 'a', 1)")
    assert q(target, "SELECT score, flag FROM t") == [("1.5", 1)]


def rows(t: SqliteTarget, table: str = "t") -> list[tuple[Any, ...]]:
    return q(t, f"SELECT * FROM \"{table}\" ORDER BY 1")


def test_add_rename_and_drop_columns_keep_the_rows(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    (add,) = src.alter("ALTER TABLE t ADD COLUMN qty int NOT NULL DEFAULT 7")
    assert isinstance(add, AddColumn)
    (rename,) = src.alter("ALTER TABLE t RENAME COLUMN name TO label")
    assert isinstance(rename, RenameColumn)
    (drop,) = src.alter("ALTER TABLE t DROP COLUMN flag")
    assert isinstance(drop, DropColumn)
    write(target, add, rename, drop)
    assert [c[:4] for c in columns(target, "t")] == [
        ("id", "INTEGER", 1, None), ("label", "TEXT", 1, None), ("score", "TEXT", 0, "'1.5'"),
        ("made", "TEXT", 0, None), ("n", "INTEGER", 1, None), ("note", "TEXT", 0, "'target only'"),
        ("qty", "INTEGER", 1, "7")]
    assert rows(target) == [(1, "a", "2.50", None, 1, "target only", 7), (2, "b", None, None, 2, "kept", 7)]
    assert indexes(target, "t") == {"t_note": (False, ["note"])}


def test_rename_table_keeps_rows_and_indexes(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    (rename,) = src.alter("ALTER TABLE t RENAME TO t2")
    assert isinstance(rename, RenameTable)
    write(target, rename)
    assert not q(target, "SELECT 1 FROM sqlite_master WHERE name = 't'")
    assert rows(target, "t2")[1] == (2, "b", None, 0, None, 2, "kept")
    assert indexes(target, "t2") == {"t_note": (False, ["note"])}
    assert target.target_exists(rename.table)


def test_a_type_change_of_another_affinity_rebuilds_the_table_keeping_what_the_target_has(
        target: SqliteTarget, src: Source) -> None:
    created(target, src)
    write(target, *src.alter("CREATE INDEX t_score ON t (score)"))
    target.conn.execute("CREATE TRIGGER t_touch AFTER UPDATE ON t BEGIN UPDATE t SET note = 'touched' "
                        "WHERE id = new.id AND note IS NOT 'touched'; END")
    (alter,) = src.alter("ALTER TABLE t ALTER COLUMN score TYPE double precision")
    assert isinstance(alter, AlterType)
    write(target, alter)
    assert columns(target, "t")[2] == ("score", "REAL", 0, "'1.5'", 0)
    assert rows(target) == [(1, "a", 2.5, 1, None, 1, "target only"), (2, "b", None, 0, None, 2, "kept")]
    assert indexes(target, "t") == {"t_note": (False, ["note"]), "t_score": (False, ["score"])}
    assert [c[4] for c in columns(target, "t")] == [1, 0, 0, 0, 0, 0, 0]  # the key stays
    target.conn.execute("UPDATE t SET name = 'c' WHERE id = 1")  # the trigger stays
    assert q(target, "SELECT note FROM t WHERE id = 1") == [("touched",)]


def test_not_null_and_default_through_the_rebuild(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    changes = src.alter("ALTER TABLE t ALTER COLUMN score SET DEFAULT 3, ALTER COLUMN name DROP NOT NULL, "
                        "ALTER COLUMN flag SET NOT NULL")
    assert sorted(type(c).__name__ for c in changes) == ["SetDefault", "SetNotNull", "SetNotNull"]
    write(target, *changes)
    assert [c[:4] for c in columns(target, "t")][1:4] == [
        ("name", "TEXT", 0, None), ("score", "TEXT", 0, "'3'"), ("flag", "INTEGER", 1, "1")]
    assert rows(target) == [(1, "a", "2.50", 1, None, 1, "target only"), (2, "b", None, 0, None, 2, "kept")]


def test_set_not_null_over_a_null_fails_in_one_line_and_changes_nothing(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    target.conn.execute("INSERT INTO t (id, name, n) VALUES (3, 'x', 3)")
    before = q(target, "SELECT sql FROM sqlite_master"), rows(target)
    changes = src.alter("ALTER TABLE t ALTER COLUMN made SET DEFAULT '2020-01-01', ALTER COLUMN score SET NOT NULL")
    setnn = next(c for c in changes if isinstance(c, SetNotNull))
    with pytest.raises(ApplyError) as err:
        write(target, *changes)
    assert str(err.value) == (f"target table 't': {setnn.describe()} at LSN {AT}: column 'score' holds NULL in 1 "
                              f"row(s)")
    assert (q(target, "SELECT sql FROM sqlite_master"), rows(target)) == before


def test_set_primary_key_and_drop_a_key_column(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    changes = src.alter("ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (n)")
    assert [type(c).__name__ for c in changes] == ["SetPrimaryKey"]
    write(target, *changes)
    assert [c[0] for c in columns(target, "t") if c[4]] == ["n"]
    changes = src.alter("ALTER TABLE t DROP COLUMN n")
    write(target, *changes)
    assert [c[0] for c in columns(target, "t")] == ["id", "name", "score", "flag", "made", "note"]
    assert [c[0] for c in columns(target, "t") if c[4]] == []
    assert rows(target) == [(1, "a", "2.50", 1, None, "target only"), (2, "b", None, 0, None, "kept")]


def test_drop_an_indexed_column_drops_its_indexes(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    write(target, *src.alter("CREATE UNIQUE INDEX t_name ON t (name, flag)"))
    assert indexes(target, "t")["t_name"] == (True, ["name", "flag"])
    changes = src.alter("ALTER TABLE t DROP COLUMN flag")
    write(target, *changes)
    assert indexes(target, "t") == {"t_note": (False, ["note"])}
    assert rows(target) == [(1, "a", "2.50", None, 1, "target only"), (2, "b", None, None, 2, "kept")]


def test_index_names_clash_across_tables(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    target.conn.execute("CREATE TABLE other (x int)")
    target.conn.execute("CREATE INDEX t_made ON other (x)")
    (create,) = src.alter("CREATE INDEX t_made ON t (made)")
    write(target, create)
    assert indexes(target, "t")["t.t_made"] == (False, ["made"])
    (drop,) = src.alter("DROP INDEX t_made")
    write(target, drop)
    assert "t.t_made" not in indexes(target, "t") and indexes(target, "other") == {"t_made": (False, ["x"])}


# -- without a server ------------------------------------------------------------------------------------------------

INT4, TEXT = 23, 25


def shape(*cols: ColumnShape, key: tuple[str, ...] = ("id",)) -> TableShape:
    return TableShape(1, "s", "t", cols, primary_key=key)


ID = ColumnShape("id", "integer", INT4, not_null=True, attnum=1)


def test_a_table_outside_public_is_named_schema_dot_table_or_as_mapped(tmp_path: Path) -> None:
    t = SqliteTarget(f"sqlite:///{tmp_path / 'm.db'}", "test", {"s.u": "mapped"})
    try:
        write(t, CreateTable(shape(ID)), CreateTable(TableShape(2, "s", "u", (ID,))))
        assert {r[0] for r in q(t, "SELECT name FROM sqlite_master WHERE type = 'table'")} == {"s.t", "mapped"}
    finally:
        t.close()


def test_a_type_change_within_the_affinity_keeps_the_declared_type(target: SqliteTarget) -> None:
    """A user's own declared type of the same affinity stays: SQLite stores the values alike, sync's check agrees."""
    target.conn.execute('CREATE TABLE "s.t" (id INT8 PRIMARY KEY, v VARCHAR(10))')
    target.conn.execute('INSERT INTO "s.t" VALUES (1, \'a\')')
    v = ColumnShape("v", "text", TEXT, attnum=2)
    write(target, AlterType(shape(ID, v), ID, "bigint"), AlterType(shape(ID, v), v, "character varying(10)"))
    assert [c[:2] for c in columns(target, "s.t")] == [("id", "INT8"), ("v", "VARCHAR(10)")]


def test_add_a_not_null_column_without_a_default(target: SqliteTarget) -> None:
    write(target, CreateTable(shape(ID)))
    v = ColumnShape("v", "text", TEXT, not_null=True, attnum=2)
    write(target, AddColumn(shape(ID, v), v))  # an empty table: the rebuild takes it
    assert columns(target, "s.t")[1] == ("v", "TEXT", 1, None, 0)
    target.conn.execute("INSERT INTO \"s.t\" VALUES (1, 'a')")
    w = ColumnShape("w", "text", TEXT, not_null=True, default="now()", attnum=3)
    with pytest.raises(ApplyError, match=r"^target table 's.t': add column 'w' text to s.t at LSN 0/16B3748: column "
                                         r"'w' is NOT NULL without a default SQLite can use, and the table holds 1 "
                                         r"row\(s\) that would have NULL in it$"):
        write(target, AddColumn(shape(ID, v, w), w))
    assert [c[0] for c in columns(target, "s.t")] == ["id", "v"]


def test_a_change_to_a_missing_column_fails_in_one_line(target: SqliteTarget) -> None:
    write(target, CreateTable(shape(ID)))
    gone = ColumnShape("gone", "text", TEXT, attnum=2)
    with pytest.raises(ApplyError, match=r"^target table 's.t': drop column 'gone' of s.t at LSN 0/16B3748: "
                                         r"no such column: 'gone'$"):
        write(target, DropColumn(shape(ID), gone))
    with pytest.raises(ApplyError, match="no such column"):
        write(target, SetDefault(shape(ID), ColumnShape("gone", "text", TEXT, default="'x'::text"), gone))


def test_a_rebuild_keeps_the_tables_and_views_that_refer_to_the_table(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    target.conn.executescript("CREATE TABLE c (id INTEGER PRIMARY KEY, t_id INTEGER REFERENCES t (id) ON DELETE CASCADE);"
                              "INSERT INTO c VALUES (10, 1), (20, 2);"
                              "CREATE VIEW v AS SELECT t.name, c.id FROM t JOIN c ON c.t_id = t.id")
    write(target, *src.alter("ALTER TABLE t ALTER COLUMN flag TYPE text"))
    assert columns(target, "t")[3][:2] == ("flag", "TEXT")
    assert q(target, "SELECT * FROM v ORDER BY 2") == [("a", 10), ("b", 20)]
    assert q(target, "PRAGMA foreign_key_list(c)")[0][2] == "t"


def test_a_rebuild_with_foreign_keys_on_and_a_referencing_table_is_refused(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    target.conn.executescript("CREATE TABLE c (id INTEGER PRIMARY KEY, t_id INTEGER REFERENCES t (id) ON DELETE CASCADE);"
                              "INSERT INTO c VALUES (10, 1), (20, 2)")
    target.conn.execute("PRAGMA foreign_keys = ON")
    (alter,) = src.alter("ALTER TABLE t ALTER COLUMN flag TYPE text")
    with pytest.raises(FinalError, match=r"^target table 't': change column 'flag' of public.t from boolean to text "
                                         r"at LSN 0/16B3748: foreign_keys is on and 'c' reference\(s\) the table"):
        write(target, alter)
    assert q(target, "SELECT count(*) FROM c") == [(2,)] and columns(target, "t")[3][:2] == ("flag", "INTEGER")


def test_drop_table_index_and_replica_identity(target: SqliteTarget, src: Source) -> None:
    created(target, src)
    write(target, *src.alter("CREATE INDEX t_flag ON t (flag)"))
    changes = src.alter("DROP INDEX t_flag; ALTER TABLE t REPLICA IDENTITY FULL")
    assert sorted(type(c).__name__ for c in changes) == ["DropIndex", "SetReplicaIdentity"]
    write(target, *changes)
    assert indexes(target, "t") == {"t_note": (False, ["note"])}
    write(target, DropTable(src.shape()))
    assert not target.target_exists(src.shape())


@pytest.mark.parametrize(("type_oid", "default", "sqlite"), [
    (INT4, "7", "7"), (INT4, "'-1'::integer", "-1"), (1700, "'-1.5'::numeric", "'-1.5'"), (1700, "1.5", "'1.5'"),
    (16, "true", "1"), (16, "false", "0"), (TEXT, "'it''s'::text", "'it''s'"), (17, "'\\x01ff'::bytea", "X'01ff'"),
    (701, "0.25", "0.25"), (TEXT, "NULL::text", "NULL"), (1082, "'2020-01-02'::date", "'2020-01-02'"),
    (INT4, "nextval('t_id_seq'::regclass)", None), (1184, "now()", None), (1184, "CURRENT_TIMESTAMP", None),
    (TEXT, "('a'::text || 'b'::text)", None), (INT4, None, None),
])
def test_constant_defaults_are_stored_as_the_engine_stores_the_value(type_oid: int, default: str | None,
                                                                     sqlite: str | None) -> None:
    assert sqlite_default(ColumnShape("c", "", type_oid, default=default)) == sqlite


def test_a_rebuild_keeps_the_rest_of_a_column_and_a_without_rowid_table(target: SqliteTarget) -> None:
    target.conn.execute('CREATE TABLE "s.t" (id INTEGER NOT NULL, v TEXT COLLATE NOCASE NOT NULL '
                        'CHECK (length(v) < 5), "w,x" TEXT DEFAULT \'a,b\', PRIMARY KEY (id)) WITHOUT ROWID')
    target.conn.execute('INSERT INTO "s.t" VALUES (1, \'abc\', \'z\')')
    v = ColumnShape("v", "text", TEXT, attnum=2)
    write(target, SetNotNull(shape(ID, v), v))
    (sql,) = q(target, "SELECT sql FROM sqlite_master WHERE name = 's.t'")[0]
    assert sql == ('CREATE TABLE "s.t" (id INTEGER NOT NULL, v TEXT COLLATE NOCASE CHECK (length(v) < 5), '
                   '"w,x" TEXT DEFAULT \'a,b\', PRIMARY KEY (id)) WITHOUT ROWID')
    assert q(target, 'SELECT * FROM "s.t"') == [(1, "abc", "z")]
    target.conn.execute('INSERT INTO "s.t" (id) VALUES (2)')  # NULL allowed now; the CHECK stays
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        target.conn.execute('INSERT INTO "s.t" (id, v) VALUES (3, \'toolong\')')
