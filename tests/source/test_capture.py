"""DDL capture on the source against real servers (PG 15 and 18).

What a user relies on: after ``install``, each DDL on a published table leaves
one ``applier.ddl`` message in its own transaction describing the table after
the command (renames keep the oid and attnum); a dropped table is listed;
unpublished tables emit nothing; ``uninstall`` leaves nothing behind.

A document, as the apply side will read it (version 1)::

    {"version": 1, "tag": "ALTER TABLE", "statement": "ALTER TABLE t ADD COLUMN n int NOT NULL DEFAULT 7",
     "tables": [{"oid": 16390, "schema": "public", "name": "t", "relkind": "r", "parent": null,
                 "columns": [{"attnum": 1, "name": "id", "type": "integer", "type_oid": 23, "typmod": -1,
                              "type_name": "pg_catalog.int4", "not_null": true, "default": null,
                              "identity": "", "generated": null}, ...],
                 "primary_key": ["id"], "replica_identity": "d", "replica_identity_index": null,
                 "indexes": [{"name": "t_pkey", "definition": "CREATE UNIQUE INDEX t_pkey ON public.t USING btree (id)",
                              "unique": true, "primary": true, "columns": ["id"]}]}],
     "dropped": []}
"""

from __future__ import annotations

import json

import pytest

from applier.ddl import shape
from applier.lsn import LSN
from applier.source import capture


@pytest.fixture
def db(source_db):
    """A database with published ``t``, unpublished ``u``, a slot ``s`` and capture installed."""
    source_db.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text)", source_db.dbname)
    source_db.cluster.execute("CREATE TABLE u (id int PRIMARY KEY)", source_db.dbname)
    source_db.cluster.execute("CREATE PUBLICATION p FOR TABLE t", source_db.dbname)
    capture.install(source_db.dsn)
    source_db.cluster.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')", source_db.dbname)
    return source_db


def sql(db, query: str) -> list[tuple]:
    return db.cluster.execute(query, db.dbname)


def documents(db) -> list[dict]:
    rows = sql(db, "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, 'proto_version', '1',"
                   " 'publication_names', 'p', 'messages', 'true')")
    docs = []
    for (data,) in rows:
        data = bytes(data)
        if data[:1] == b"M" and b"applier.ddl\x00" in data:
            body = data[data.index(b"applier.ddl\x00") + len(b"applier.ddl\x00") + 4:]
            docs.append(json.loads(body))
    return docs


def test_add_and_rename_column_describe_the_table_after_each_command(db):
    sql(db, "BEGIN; INSERT INTO t VALUES (1, 'a'); ALTER TABLE t ADD COLUMN n int NOT NULL DEFAULT 7;"
            " ALTER TABLE t RENAME COLUMN v TO w; INSERT INTO t VALUES (2, 'b'); COMMIT")
    first, second = documents(db)
    assert first["version"] == 1 and first["tag"] == "ALTER TABLE" and first["dropped"] == []
    (table,) = first["tables"]
    assert (table["schema"], table["name"], table["relkind"], table["parent"]) == ("public", "t", "r", None)
    assert [(c["attnum"], c["name"], c["type"], c["not_null"], c["default"]) for c in table["columns"]] == [
        (1, "id", "integer", True, None), (2, "v", "text", False, None), (3, "n", "integer", True, "7")]
    assert table["primary_key"] == ["id"] and table["replica_identity"] == "d"
    assert table["indexes"] == [{"name": "t_pkey", "definition": "CREATE UNIQUE INDEX t_pkey ON public.t USING btree (id)",
                                 "unique": True, "primary": True, "columns": ["id"]}]
    (renamed,) = second["tables"]
    assert renamed["oid"] == table["oid"] == int(sql(db, "SELECT 't'::regclass::oid")[0][0])
    assert [(c["attnum"], c["name"]) for c in renamed["columns"]] == [(1, "id"), (2, "w"), (3, "n")]


def test_drop_of_a_published_table_lists_it(db):
    (oid,) = sql(db, "SELECT 't'::regclass::oid")[0]
    sql(db, "DROP TABLE t")
    (doc,) = documents(db)
    assert doc["tag"] == "DROP TABLE" and doc["tables"] == []
    assert doc["dropped"] == [{"oid": int(oid), "schema": "public", "name": "t"}]


def test_unpublished_tables_emit_nothing(db):
    sql(db, "ALTER TABLE u ADD COLUMN x int")
    sql(db, "DROP TABLE u")
    assert documents(db) == []


def test_uninstall_removes_everything(db):
    assert capture.state(db.dsn) == capture.CaptureState(True, 1)
    assert capture.uninstall(db.dsn) is True
    assert sql(db, "SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE 'applier_ddl%'") == [(0,)]
    assert sql(db, "SELECT count(*) FROM pg_namespace WHERE nspname = 'applier_ddl'") == [(0,)]
    assert capture.uninstall(db.dsn) is False
    assert capture.state(db.dsn) == capture.CaptureState(False, None)


def test_a_table_added_to_a_publication_is_described(db):
    sql(db, "ALTER PUBLICATION p ADD TABLE u")
    (doc,) = documents(db)
    assert doc["tag"] == "ALTER PUBLICATION"
    assert [(t["name"], [c["name"] for c in t["columns"]]) for t in doc["tables"]] == [("u", ["id"])]


def test_a_non_superuser_owners_ddl_is_captured_without_execute_on_emit(db):
    sql(db, "DO $$ DECLARE f regprocedure; BEGIN FOR f IN SELECT oid FROM pg_proc"
            " WHERE proname = 'pg_logical_emit_message' LOOP"
            " EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f); END LOOP; END $$")
    sql(db, "CREATE ROLE capture_owner; ALTER TABLE t OWNER TO capture_owner")
    try:
        sql(db, "SET ROLE capture_owner; ALTER TABLE t ALTER COLUMN v SET NOT NULL; RESET ROLE")
        (doc,) = [d for d in documents(db) if "SET NOT NULL" in d["statement"]]
        assert [(c["name"], c["not_null"]) for c in doc["tables"][0]["columns"]] == [("id", True), ("v", True)]
    finally:
        sql(db, "DROP TABLE t; DROP ROLE capture_owner")


def test_a_failing_description_lets_the_ddl_commit_with_error(db):
    sql(db, "CREATE OR REPLACE FUNCTION applier_ddl.describe(rel oid) RETURNS jsonb LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'cannot describe %', rel; END $$")
    (oid,) = sql(db, "SELECT 't'::regclass::oid")[0]
    sql(db, "ALTER TABLE t ADD COLUMN x int")
    assert sql(db, "SELECT count(*) FROM pg_attribute WHERE attrelid = 't'::regclass AND attname = 'x'") == [(1,)]
    (doc,) = documents(db)
    assert doc["error"] == f"cannot describe {oid}" and doc["tag"] == "ALTER TABLE"
    assert doc["table"] == {"oid": int(oid), "name": "public.t"}


def test_rename_set_schema_index_and_replica_identity_keep_the_oid(db):
    sql(db, "CREATE SCHEMA s2")
    sql(db, "BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE UNIQUE INDEX t_v ON t (v); ALTER TABLE t ALTER COLUMN v SET"
            " NOT NULL; ALTER TABLE t REPLICA IDENTITY USING INDEX t_v; COMMIT")
    sql(db, "ALTER TABLE t RENAME TO t2")
    sql(db, "ALTER TABLE t2 SET SCHEMA s2")
    docs = documents(db)
    assert [d["tag"] for d in docs] == ["CREATE INDEX", "ALTER TABLE", "ALTER TABLE", "ALTER TABLE", "ALTER TABLE"]
    identity = docs[2]["tables"][0]
    assert (identity["replica_identity"], identity["replica_identity_index"]) == ("i", "t_v")
    assert [(i["name"], i["unique"], i["columns"]) for i in docs[0]["tables"][0]["indexes"]] == [
        ("t_pkey", True, ["id"]), ("t_v", True, ["v"])]
    assert {d["tables"][0]["oid"] for d in docs} == {docs[0]["tables"][0]["oid"]}
    assert [(d["tables"][0]["schema"], d["tables"][0]["name"]) for d in docs[3:]] == [("public", "t2"), ("s2", "t2")]


def test_partitions_created_under_for_all_tables_are_described_with_their_parent(db):
    sql(db, "CREATE PUBLICATION everything FOR ALL TABLES")
    sql(db, "CREATE TABLE m (id int, k int) PARTITION BY RANGE (k)")
    sql(db, "CREATE TABLE m1 PARTITION OF m FOR VALUES FROM (0) TO (10)")
    docs = documents(db)
    assert [d["tag"] for d in docs[-2:]] == ["CREATE TABLE", "CREATE TABLE"]
    parent, part = docs[-2]["tables"][0], docs[-1]["tables"][0]
    assert (parent["name"], parent["relkind"], parent["parent"]) == ("m", "p", None)
    assert (part["name"], part["relkind"], part["parent"]) == ("m1", "r", parent["oid"])


@pytest.mark.parametrize("via_root", [False, True])
def test_a_command_on_a_partitioned_table_describes_its_partitions_with_their_bounds(db, via_root):
    sql(db, f"CREATE PUBLICATION everything FOR ALL TABLES WITH (publish_via_partition_root = {via_root})")
    sql(db, "CREATE TABLE m (id int, k int) PARTITION BY RANGE (k)")
    sql(db, "CREATE TABLE m1 PARTITION OF m FOR VALUES FROM (0) TO (10) PARTITION BY LIST (id)")
    sql(db, "CREATE TABLE m11 PARTITION OF m1 DEFAULT")
    sql(db, "CREATE TABLE x (id int, k int, c int)")
    sql(db, "ALTER TABLE m ADD COLUMN c int")
    sql(db, "ALTER TABLE m ATTACH PARTITION x FOR VALUES FROM (10) TO (20)")
    sql(db, "ALTER TABLE m DETACH PARTITION x")
    add, attach, detach = documents(db)[-3:]
    described = [(t["name"], t["relkind"], t["partition_bound"], t["via_root"], [c["name"] for c in t["columns"]])
                 for t in add["tables"]]
    assert described == [("m", "p", None, via_root, ["id", "k", "c"]),
                         ("m1", "p", "FOR VALUES FROM (0) TO (10)", via_root, ["id", "k", "c"]),
                         ("m11", "r", "DEFAULT", via_root, ["id", "k", "c"])]
    assert [(t["name"], t["partition_bound"]) for t in attach["tables"]] == [
        ("m", None), ("m1", "FOR VALUES FROM (0) TO (10)"), ("m11", "DEFAULT"),
        ("x", "FOR VALUES FROM (10) TO (20)")]  # in OID order (the follower takes a parent before its partitions)
    assert [t["name"] for t in detach["tables"]] == ["m", "m1", "m11"]  # x is gone from the tree
    assert [shape.parse(json.dumps(d), LSN(1)).tables[-1].sent for d in (add, detach)] == [not via_root] * 2
    plain = sql(db, "SELECT applier_ddl.describe('x'::regclass)::text")[0][0]
    assert (json.loads(plain)["partition_bound"], json.loads(plain)["via_root"]) == (None, None)


def columns(doc: dict, table: int = 0) -> list[tuple]:
    return [(c["attnum"], c["name"], c["type"], c["type_oid"], c["not_null"], c["default"], c["identity"],
             c["generated"]) for c in doc["tables"][table]["columns"]]


def test_alter_column_type_keeps_the_attnum_and_names_the_new_type(db):
    sql(db, "ALTER TABLE t ADD COLUMN n int")
    sql(db, "ALTER TABLE t ALTER COLUMN n TYPE bigint, ALTER COLUMN v TYPE varchar(20)")
    _, doc = documents(db)
    assert columns(doc) == [(1, "id", "integer", 23, True, None, "", None),
                            (2, "v", "character varying(20)", 1043, False, None, "", None),
                            (3, "n", "bigint", 20, False, None, "", None)]
    assert doc["tables"][0]["columns"][1]["typmod"] == 24 and doc["tables"][0]["columns"][1]["type_name"] == \
        "pg_catalog.varchar"


def test_identity_added_and_dropped(db):
    sql(db, "ALTER TABLE t ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY")
    sql(db, "ALTER TABLE t ALTER COLUMN id SET GENERATED BY DEFAULT")
    sql(db, "ALTER TABLE t ALTER COLUMN id DROP IDENTITY")
    docs = documents(db)
    assert [d["tag"] for d in docs] == ["ALTER TABLE"] * 3
    assert [(d["tables"][0]["columns"][0]["identity"], d["tables"][0]["columns"][0]["default"]) for d in docs] == [
        ("a", None), ("d", None), ("", None)]


def test_generated_column_has_its_expression_and_no_default(db):
    sql(db, "ALTER TABLE t ADD COLUMN g int GENERATED ALWAYS AS (id * 2) STORED")
    (doc,) = documents(db)
    assert columns(doc)[2] == (3, "g", "integer", 23, False, None, "", "(id * 2)")


def test_tables_in_schema_publication_describes_its_tables(db):
    sql(db, "CREATE SCHEMA s; CREATE TABLE s.a (id int PRIMARY KEY); CREATE TABLE s.b (id int)")
    assert documents(db) == []  # s is not published yet
    sql(db, "ALTER PUBLICATION p ADD TABLES IN SCHEMA s")
    sql(db, "CREATE TABLE s.c (id int)")
    sql(db, "ALTER TABLE s.b ADD COLUMN x text")
    added, created, altered = documents(db)
    assert (added["tag"], [(t["schema"], t["name"]) for t in added["tables"]]) == (
        "ALTER PUBLICATION", [("s", "a"), ("s", "b")])
    assert (created["tag"], [t["name"] for t in created["tables"]]) == ("CREATE TABLE", ["c"])
    assert [c["name"] for c in altered["tables"][0]["columns"]] == ["id", "x"]


def test_drop_index_describes_the_table_after_the_drop(db):
    sql(db, "CREATE INDEX t_v ON t (v); CREATE INDEX t_w ON t (v, id); CREATE INDEX u_i ON u (id)")
    documents(db)
    sql(db, "DROP INDEX t_v")
    sql(db, "DROP INDEX CONCURRENTLY t_w")
    sql(db, "DROP INDEX u_i")  # unpublished table: nothing
    sql(db, "DROP INDEX IF EXISTS nothing_here")
    docs = documents(db)
    assert [(d["tag"], [t["name"] for t in d["tables"]], d["dropped"], d["unpublished"]) for d in docs] == [
        ("DROP INDEX", ["t"], [], []), ("DROP INDEX", ["t"], [], [])]
    assert [[i["name"] for i in d["tables"][0]["indexes"]] for d in docs] == [["t_pkey", "t_w"], ["t_pkey"]]


def test_alter_publication_drop_table_lists_it_unpublished_with_the_publications_left(db):
    (oid,) = sql(db, "SELECT 't'::regclass::oid")[0]
    sql(db, "CREATE PUBLICATION q FOR TABLE t")
    sql(db, "ALTER PUBLICATION p DROP TABLE t")
    sql(db, "ALTER PUBLICATION q DROP TABLE t")
    first, second = documents(db)
    assert (first["tag"], first["tables"], first["dropped"]) == ("ALTER PUBLICATION", [], [])
    assert first["unpublished"] == [{"oid": int(oid), "schema": "public", "name": "t", "publications": ["q"]}]
    assert second["unpublished"] == [{"oid": int(oid), "schema": "public", "name": "t", "publications": []}]
    captured = shape.parse(json.dumps(second), LSN(1))
    assert captured.unpublished == (shape.UnpublishedTable(int(oid), "public", "t", ()),)


def test_set_table_lists_the_removed_then_describes_the_added(db):
    sql(db, "ALTER PUBLICATION p SET TABLE u")
    removed, added = documents(db)
    assert [(u["name"], u["publications"]) for u in removed["unpublished"]] == [("t", [])]
    assert ([t["name"] for t in added["tables"]], added.get("unpublished", [])) == (["u"], [])


def test_drop_tables_in_schema_lists_the_schemas_tables(db):
    sql(db, "CREATE SCHEMA s; CREATE TABLE s.a (id int); ALTER PUBLICATION p ADD TABLES IN SCHEMA s")
    documents(db)
    sql(db, "ALTER PUBLICATION p DROP TABLES IN SCHEMA s")
    (doc,) = documents(db)
    assert [(u["schema"], u["name"], u["publications"]) for u in doc["unpublished"]] == [("s", "a", [])]


def test_dropping_a_table_does_not_list_it_unpublished(db):
    sql(db, "DROP TABLE t")
    (doc,) = documents(db)
    assert doc["unpublished"] == [] and [d["name"] for d in doc["dropped"]] == ["t"]


def test_install_writes_a_baseline_of_every_published_table(source_db):
    sql(source_db, "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (id int); CREATE SCHEMA s;"
                   " CREATE TABLE s.a (id int); CREATE PUBLICATION p FOR TABLE t, TABLES IN SCHEMA s")
    sql(source_db, "SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    capture.install(source_db.dsn)
    (doc,) = documents(source_db)
    assert (doc["tag"], doc["statement"], doc["dropped"]) == (shape.BASELINE_TAG, "applier ddl install", [])
    assert [(t["schema"], t["name"], [c["attnum"] for c in t["columns"]]) for t in doc["tables"]] == [
        ("public", "t", [1, 2]), ("s", "a", [1])]
    assert shape.parse(json.dumps(doc), LSN(1)).baseline
