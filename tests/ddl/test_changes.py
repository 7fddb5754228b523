"""The schema-change model without a server: capture documents read, and the changes between two shapes."""

from __future__ import annotations

import json

import pytest

from applier.ddl.changes import (
    AddColumn,
    AlterType,
    AmbiguousColumns,
    CreateIndex,
    DdlClass,
    DropColumn,
    DropIndex,
    RenameColumn,
    RenameTable,
    SetDefault,
    SetNotNull,
    SetPrimaryKey,
    SetReplicaIdentity,
    diff,
)
from applier.ddl.shape import ColumnShape, IndexShape, TableShape, parse
from applier.errors import FinalError
from applier.lsn import LSN

AT = LSN.parse("0/1234")


def col(name: str, attnum: int | None, typ: str = "integer", oid: int = 23, **kw: object) -> ColumnShape:
    return ColumnShape(name, typ, oid, attnum=attnum, **kw)  # type: ignore[arg-type]


def table(*cols: ColumnShape, name: str = "t", **kw: object) -> TableShape:
    return TableShape(16384, "public", name, cols, **kw)  # type: ignore[arg-type]


BASE = table(col("id", 1, not_null=True), col("b", 2, "text", 25), primary_key=("id",),
             indexes=(IndexShape("t_pkey", "CREATE UNIQUE INDEX t_pkey ON public.t USING btree (id)", True, True,
                                 ("id",)),))


def test_the_same_shape_has_no_changes() -> None:
    assert diff(BASE, BASE) == []


def test_a_rename_keeps_its_attnum_and_is_not_a_drop_and_an_add() -> None:
    new = table(col("id", 1, not_null=True), col("bb", 2, "text", 25), primary_key=("id",), indexes=BASE.indexes)
    assert diff(BASE, new) == [RenameColumn(new, "b", "bb")]


def test_a_drop_and_an_add_of_the_same_name_are_two_columns() -> None:
    # ALTER TABLE t DROP COLUMN b, ADD COLUMN b text: a new attnum, so the values of the old b are gone
    new = table(col("id", 1, not_null=True), col("b", 3, "text", 25), primary_key=("id",), indexes=BASE.indexes)
    assert [type(c) for c in diff(BASE, new)] == [DropColumn, AddColumn]


def test_every_kind_of_change_in_the_order_a_target_applies_them() -> None:
    new = table(col("id", 1, not_null=True), col("b", 2, "character varying(5)", 1043, typmod=9, not_null=True,
                                                  default="'x'::character varying"),
                col("c", 3, "bigint", 20), name="t2", primary_key=("id", "c"), replica_identity="f",
                indexes=(IndexShape("t2_b", "CREATE INDEX t2_b ON public.t2 USING btree (b)", columns=("b",)),))
    changes = diff(BASE, new)
    assert [type(c) for c in changes] == [RenameTable, AddColumn, AlterType, SetDefault, SetNotNull, SetPrimaryKey,
                                          CreateIndex, SetReplicaIdentity]
    assert changes[0].describe() == "rename table public.t to public.t2"
    assert changes[2].describe() == "change column 'b' of public.t2 from text to character varying(5)"
    assert {c.klass for c in changes} >= {DdlClass.RENAME_TABLE, DdlClass.INDEX, DdlClass.NOT_NULL}


def test_an_index_on_a_renamed_column_is_the_same_index() -> None:
    old = table(col("id", 1), col("b", 2), indexes=(IndexShape("t_b", "CREATE INDEX t_b ON public.t USING btree (b)",
                                                                columns=("b",)),))
    new = table(col("id", 1), col("bb", 2), indexes=(IndexShape("t_b", "CREATE INDEX t_b ON public.t USING btree (bb)",
                                                                 columns=("bb",)),))
    assert diff(old, new) == [RenameColumn(new, "b", "bb")]
    gone = table(col("id", 1), col("b", 2))
    assert [type(c) for c in diff(old, gone)] == [DropIndex]


def test_shapes_from_relation_messages_pair_by_name_and_refuse_to_guess() -> None:
    old = table(col("id", None), col("b", None), captured=False)
    renamed = table(col("id", None), col("bb", None), captured=False)
    with pytest.raises(AmbiguousColumns) as e:
        diff(old, renamed)
    assert "'b'" in str(e.value) and "'bb'" in str(e.value) and "public.t" in str(e.value)
    added = table(col("id", None), col("b", None), col("c", None), captured=False)
    assert [type(c) for c in diff(old, added)] == [AddColumn]


def test_a_capture_document_is_read_and_round_trips() -> None:
    doc = {"version": 1, "tag": "ALTER TABLE", "statement": "alter table t rename b to bb",
           "tables": [{"oid": 16384, "schema": "public", "name": "t", "relkind": "r", "parent": None,
                       "columns": [{"attnum": 1, "name": "id", "type": "integer", "type_oid": 23, "typmod": -1,
                                    "type_name": "pg_catalog.int4", "not_null": True, "default": None,
                                    "identity": "a", "generated": None}],
                       "primary_key": ["id"], "replica_identity": "d", "replica_identity_index": None,
                       "indexes": []}],
           "dropped": [{"oid": 16390, "schema": "public", "name": "gone"}]}
    got = parse(json.dumps(doc).encode(), AT)
    assert got.tag == "ALTER TABLE" and got.dropped[0].qualified == "public.gone" and not got.baseline
    shape = got.tables[0]
    assert shape.columns[0].identity == "a" and shape.primary_key == ("id",) and shape.captured
    assert TableShape.from_json(shape.to_json()) == shape


def test_a_document_of_another_version_or_no_json_is_refused_naming_the_lsn() -> None:
    with pytest.raises(FinalError, match=r"version 2.*0/1234|0/1234.*version 2"):
        parse(b'{"version": 2, "tag": "ALTER TABLE"}', AT)
    with pytest.raises(FinalError, match="0/1234"):
        parse(b"not json", AT)


def test_capture_that_could_not_describe_says_so() -> None:
    got = parse(b'{"version": 1, "tag": "ALTER TABLE", "statement": "s", "error": "boom",'
                b' "table": {"oid": 5, "name": "public.t"}}', AT)
    assert got.error == "boom" and got.error_table == (5, "public.t")


def test_a_renamed_or_moved_table_keeps_its_indexes() -> None:
    """The index definitions name the table: a table renamed (or moved to another schema) has the same indexes,
    on columns or on expressions, and is one RenameTable (never a drop and a rebuild of each index)."""
    def shaped(schema: str, name: str) -> TableShape:
        return TableShape(16384, schema, name, (col("id", 1), col("b", 2, "text", 25)), indexes=(
            IndexShape("t_b", f"CREATE INDEX t_b ON {schema}.{name} USING btree (b)", columns=("b",)),
            IndexShape("t_lb", f"CREATE INDEX t_lb ON {schema}.{name} USING btree (lower(b))")))
    old, new = shaped("public", "t"), shaped("s2", "t2")
    assert diff(old, new) == [RenameTable(new, "public", "t")]
