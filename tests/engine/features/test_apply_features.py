"""What the apply engine does with each kind of change, checked on the target as a user would.

Every test runs on a PostgreSQL target and on a SQLite target, against each
installed PostgreSQL major as the source (``rig``, see conftest.py). The source
makes ordinary SQL changes; ``catchup`` applies them through the real slot; the
test reads the target's tables.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from applier.config import ConfigError
from applier.engine.runner import Runner
from applier.errors import ApplyError
from applier.lsn import LSN
from applier.sandbox.clusters import Cluster
from tests.plugins.cli import run_cli
from tests.plugins.clusters import scratch_db

from .conftest import Rig

LSN_IN_TEXT = re.compile(r"\b([0-9A-F]{1,8}/[0-9A-F]{1,8})\b")


def rows_sorted(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows in an order that does not depend on how a database sorts NULLs."""
    return sorted(rows, key=repr)


def assert_same(rig: Rig, src_query: str, tgt_query: str | None = None) -> list[tuple[Any, ...]]:
    """The query gives the same rows (as a multiset) on the source and the target; returns them."""
    src = rows_sorted(rig.src(src_query))
    assert rows_sorted(rig.tgt(tgt_query or src_query)) == src
    return src


def wait_for(check: Callable[[], bool], what: str, timeout: float = 20.0, errors: list[BaseException] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if errors:
            raise AssertionError(f"the applier failed while waiting for {what}") from errors[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- locating rows ---------------------------------------------------------------


def test_default_identity_insert_update_delete_and_key_change(rig: Rig) -> None:
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text, n int)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'one', 10), (2, 'two', 20), (3, 'three', NULL), (4, 'four', 4)")
    rig.src("UPDATE t SET v = 'TWO', n = NULL WHERE id = 2")  # key unchanged: found by the new tuple's key
    rig.src("UPDATE t SET id = 30, v = 'moved' WHERE id = 3")  # key changed: found by the K tuple
    rig.src("DELETE FROM t WHERE id = 1")
    rig.catchup()
    assert rig.tgt("SELECT id, v, n FROM t ORDER BY id") == [(2, "TWO", None), (4, "four", 4), (30, "moved", None)]


def test_replica_identity_full_finds_exactly_one_row_null_safe(rig: Rig) -> None:
    """No key at all: every column is compared (NULL = NULL), and only one of identical rows is touched."""
    rig.both("CREATE TABLE t (a int, b text, c int)")
    rig.src("ALTER TABLE t REPLICA IDENTITY FULL")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'x', NULL), (1, 'x', NULL), (1, 'x', NULL), (2, 'y', 5), (2, 'y', 5), "
            "(3, NULL, NULL), (4, 'w', 4)")
    rig.catchup()
    # one of three identical rows, one of two identical rows; ctid picks exactly one on the source
    rig.src("DELETE FROM t WHERE ctid = (SELECT ctid FROM t WHERE a = 1 LIMIT 1)")
    rig.src("UPDATE t SET c = 6 WHERE ctid = (SELECT ctid FROM t WHERE a = 2 LIMIT 1)")
    rig.src("UPDATE t SET b = 'now set' WHERE a = 3")  # found although b and c are NULL
    rig.src("DELETE FROM t WHERE a = 4")
    rig.catchup()
    rows = assert_same(rig, "SELECT a, b, c FROM t")
    assert rows == rows_sorted([(1, "x", None), (1, "x", None), (2, "y", 5), (2, "y", 6), (3, "now set", None)])


def test_replica_identity_using_index(rig: Rig) -> None:
    """The key is the columns of the unique index named by REPLICA IDENTITY USING INDEX, not id."""
    rig.both("CREATE TABLE t (id int NOT NULL, code text NOT NULL, v text)")
    rig.src("CREATE UNIQUE INDEX t_code ON t (code); ALTER TABLE t REPLICA IDENTITY USING INDEX t_code")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a', 'x'), (1, 'b', 'y'), (1, 'c', 'z')")  # same id everywhere
    rig.src("UPDATE t SET v = 'x2' WHERE code = 'a'")
    rig.src("UPDATE t SET code = 'bb', v = 'y2' WHERE code = 'b'")
    rig.src("DELETE FROM t WHERE code = 'c'")
    rig.catchup()
    assert rig.tgt("SELECT id, code, v FROM t ORDER BY code") == [(1, "a", "x2"), (1, "bb", "y2")]


def test_unchanged_toast_value_is_kept(rig: Rig) -> None:
    """An update of another column sends the big value as 'unchanged' (u); the target keeps its copy."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, big text, n int)")
    rig.src("ALTER TABLE t ALTER COLUMN big SET STORAGE EXTERNAL")  # out of line and never compressed
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT 1, string_agg(md5(random()::text), ''), 0 FROM generate_series(1, 400)")
    rig.catchup()
    rig.src("UPDATE t SET n = 1 WHERE id = 1")
    update = [m for m in rig.peek() if m["type"] == "Update"]
    assert [c["kind"] for c in update[0]["new"]] == ["t", "u", "t"]  # the case under test really happens
    rig.catchup()
    (big, n), = rig.src("SELECT big, n FROM t")
    assert len(big) > 8192
    assert rig.tgt("SELECT big, n FROM t") == [(big, 1)]


def test_large_transactions_locate_rows_the_same_way(rig: Rig) -> None:
    """Many changes per transaction (batched, possibly folded per row or applied set-wise by the engine):
    key changes, unchanged TOAST values, and one-of-identical-rows deletes come out as on the source."""
    rig.both("CREATE TABLE k (id int PRIMARY KEY, big text, n int)")
    rig.both("CREATE TABLE f (a int, b text)")
    rig.src("ALTER TABLE k ALTER COLUMN big SET STORAGE EXTERNAL; ALTER TABLE f REPLICA IDENTITY FULL")
    rig.publish("k", "f")
    rig.init()
    rig.src("INSERT INTO k SELECT g, CASE WHEN g % 3 = 0 THEN (SELECT string_agg(md5(random()::text || i || g), '') "
            "FROM generate_series(1, 300) i) ELSE 'small ' || g END, 0 FROM generate_series(1, 60) g; "
            "INSERT INTO f SELECT 1, 'same' FROM generate_series(1, 20); INSERT INTO f VALUES (2, NULL), (2, NULL)")
    rig.catchup()
    rig.src("UPDATE k SET n = n + 1; UPDATE k SET n = n + 10 WHERE id % 2 = 0; DELETE FROM k WHERE id % 5 = 0; "
            "INSERT INTO k SELECT g, (SELECT string_agg(md5(random()::text || i || g), '') "
            "FROM generate_series(1, 300) i), 7 FROM generate_series(100, 110) g; "
            "UPDATE k SET n = -1 WHERE id >= 100")  # inserted and updated in one transaction
    rig.src("UPDATE k SET id = id + 1000 WHERE id <= 20")  # key changes
    rig.src("DELETE FROM f WHERE ctid IN (SELECT ctid FROM f WHERE a = 1 LIMIT 7); "
            "UPDATE f SET b = 'one' WHERE ctid = (SELECT ctid FROM f WHERE a = 2 LIMIT 1)")
    rig.catchup()
    rows = assert_same(rig, "SELECT id, big, n FROM k")
    assert len(rows) == 59 and sum(r[0] > 1000 for r in rows) == 16
    assert rows_sorted(rig.tgt("SELECT a, b FROM f")) == rows_sorted([(1, "same")] * 13 + [(2, None), (2, "one")])


def test_a_transaction_of_large_rows_comes_out_as_on_the_source(rig: Rig) -> None:
    """Rows of ~10 kB go to the target about a megabyte a batch (``applier.engine.batch``), not 2,000 rows: one
    transaction inserts 300 of them, updates some (their text unchanged or not) and deletes some, with the
    batches' boundaries falling between a row's insert and its later changes."""
    rig.both("CREATE TABLE w (id int PRIMARY KEY, body text, n int)")
    rig.src("ALTER TABLE w ALTER COLUMN body SET STORAGE EXTERNAL")
    rig.publish("w")
    rig.init()
    body = "(SELECT string_agg(md5(random()::text || i || g), '') FROM generate_series(1, 320) i)"
    rig.src(f"BEGIN; INSERT INTO w SELECT g, {body}, 0 FROM generate_series(1, 300) g; "
            "UPDATE w SET n = 3 WHERE id = 299; DELETE FROM w WHERE id = 298; "  # into the last, measured batch
            "UPDATE w SET n = 1 WHERE id % 7 = 0; DELETE FROM w WHERE id % 11 = 0; "
            f"UPDATE w SET body = {body.replace('g)', 'id)')} WHERE id % 13 = 0; "
            f"INSERT INTO w SELECT g, {body}, 2 FROM generate_series(301, 350) g; "
            "UPDATE w SET n = n + 5 WHERE id % 3 = 0; COMMIT")
    rig.catchup()
    rows = assert_same(rig, "SELECT id, body, n FROM w")
    assert len(rows) == 350 - 28 and min(len(r[1]) for r in rows) == 10_240


def test_rows_missing_on_the_target_are_logged_and_skipped(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """As the native subscriber's update_missing/delete_missing: the other rows apply, each missing one is named
    and recorded in applier_conflicts (the batch that missed them is applied again row by row)."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, n int)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT g, 0 FROM generate_series(1, 100) g")
    rig.catchup()
    rig.tgt("DELETE FROM t WHERE id > 90 OR id = 5")  # 11 rows gone from the target only
    rig.src("UPDATE t SET n = 1")  # a batch of 100, 11 of them missing
    rig.src("DELETE FROM t WHERE id > 80")  # a batch of 20, 10 of them missing
    rig.src("UPDATE t SET n = 2 WHERE id = 5")  # one row, missing
    rig.src("INSERT INTO t VALUES (1000, 3)")
    with caplog.at_level(logging.WARNING, logger="applier"):
        rig.catchup()
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("conflict ")]
    assert sum(m.startswith("conflict update_missing: row to be updated") for m in logged) == 12, logged
    assert sum(m.startswith("conflict delete_missing: row to be deleted") for m in logged) == 10, logged
    assert any("(id)=(5) " in m and m.startswith("conflict update_missing") for m in logged), logged
    assert rig.tgt("SELECT count(*), sum(n) FROM t") == [(80, 79 + 3)]
    assert rig.tgt("SELECT conflict_type, key, resolution FROM applier_conflicts WHERE key IN ('(id)=(5)', '(id)=(95)') "
                   "ORDER BY 1, 2") == [("delete_missing", "(id)=(95)", "skip"), ("update_missing", "(id)=(5)", "skip"),
                                        ("update_missing", "(id)=(5)", "skip"), ("update_missing", "(id)=(95)", "skip")]


# text key values holding what an array literal or COPY treats specially
ODD_TEXTS = ['q"uote', "back\\slash", "com,ma", "{brace}", " lead space", "NULL", "", "tab\there", "new\nline", "ünï"]


def test_keyed_batches_with_composite_and_array_keys_odd_values_and_missing_rows(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """Batches of updates and deletes (one statement per batch on PostgreSQL, each column's values as one array)
    find rows by a composite key whose text part holds quotes, backslashes, commas, braces, 'NULL' and ''; and
    by a key that is an array; NULL and quoted values are set as sent; missing rows are counted, the rest apply."""
    rig.both("CREATE TABLE t (a int, b text, n int, note varchar(20), PRIMARY KEY (a, b))")
    rig.both("CREATE TABLE arr (k int[] PRIMARY KEY, v text)", "CREATE TABLE arr (k TEXT PRIMARY KEY, v TEXT)")
    rig.publish("t", "arr")
    rig.init()
    rig.src("INSERT INTO t SELECT a, b, 0, 'x' FROM generate_series(1, 3) a, unnest(%s::text[]) b", [ODD_TEXTS])
    rig.src("INSERT INTO arr SELECT ARRAY[g, g + 1], 'v' FROM generate_series(1, 12) g")
    rig.catchup()
    rig.tgt("""DELETE FROM t WHERE (a = 1 AND b IN ('NULL', '')) OR (a = 2 AND b = 'q"uote') OR (a = 3 AND b = 'com,ma')""")
    rig.tgt("DELETE FROM arr WHERE v = 'v' AND CAST(k AS text) IN ('{1,2}', '{12,13}')")
    rig.src("UPDATE t SET n = n + a, note = CASE WHEN a = 1 THEN NULL ELSE b || '\"\\' END")  # 30 rows, 4 missing
    rig.src("UPDATE arr SET v = 'w' || array_length(k, 1)")  # 12 rows, 2 missing
    rig.src("DELETE FROM t WHERE a <= 2")  # 20 rows, 3 missing
    rig.src("DELETE FROM arr WHERE k[1] <= 10")  # 10 rows, 1 missing
    with caplog.at_level(logging.WARNING, logger="applier"):
        rig.catchup()
    counted = rig.tgt("SELECT conflict_type, table_name, count(*) FROM applier_conflicts GROUP BY 1, 2 ORDER BY 1, 2")
    assert [(k, re.sub("^public[.]", "", t), n) for k, t, n in counted] == [
        ("delete_missing", "arr", 1), ("delete_missing", "t", 3), ("update_missing", "arr", 2),
        ("update_missing", "t", 4)], counted
    assert sum(r.getMessage().startswith("conflict ") for r in caplog.records) == 10
    src = rig.src("SELECT a, b, n, note FROM t WHERE NOT (a = 3 AND b = 'com,ma')")
    assert len(src) == 9 and rows_sorted(rig.tgt("SELECT a, b, n, note FROM t")) == rows_sorted(src)
    assert rig.tgt("SELECT CAST(k AS text), v FROM arr ORDER BY v, 1") == [("{11,12}", "w2")]


@pytest.mark.parametrize("target_kind", ["postgresql"], indirect=True)
def test_batches_keep_values_of_types_with_a_length(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A batch's values travel as arrays of the column's type without its modifier: char(n), bit(n), varchar(n),
    numeric(p,s) and arrays of them keep their whole value (char(6) is not cut to char(1)), keys of them too;
    a box (whose array literal is not comma-separated) arrives too."""
    ddl = ("CREATE TABLE t (code char(6), b bit(4), v varchar(5), num numeric(6,2), ca char(3)[], "
           "n int, bx box, PRIMARY KEY (code, b))")  # (box: an array literal of boxes separates them with ';')
    rig.both(ddl)
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT lpad(g::text, 4, '0'), (g % 16)::bit(4), 'v' || g, g / 3.0, "
            "ARRAY[g::text, 'xy'], 0 FROM generate_series(1, 12) g")
    rig.catchup()
    rig.src("UPDATE t SET n = 1, v = 'w' || n, num = num + 1000, ca = ARRAY['abc', NULL], "
            "bx = box(point(n, 1), point(0, 0))")  # 12 updates: one batch
    rig.src("DELETE FROM t WHERE code > '0009'")  # 3 deletes by the (char, bit) key
    with caplog.at_level(logging.WARNING, logger="applier"):
        rig.catchup()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # no retry row by row
    query = "SELECT code, b::text, v, num::text, ca::text, n, bx::text FROM t ORDER BY 1"
    got = rig.tgt(query)
    assert got == rig.src(query) and len(got) == 9
    assert got[0] == ("0001  ", "0001", "w0", "1000.33", "{abc,NULL}", 1, "(0,1),(0,0)")


@pytest.mark.parametrize("target_kind", ["postgresql"], indirect=True)
def test_batches_apply_for_a_target_role_without_temporary_tables(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A target role that may not create temporary tables (TEMPORARY revoked, as hardened databases do) applies
    batches of updates and deletes as they are, without failing over to row by row."""
    assert rig.target is not None
    db, role = rig.target.dbname, f"{rig.target.dbname}_owner"
    rig.src("CREATE TABLE t (id int PRIMARY KEY, n int)")
    rig.tgt_script(f"CREATE ROLE {role} LOGIN; ALTER DATABASE {db} OWNER TO {role}; "
                   f"REVOKE TEMPORARY ON DATABASE {db} FROM PUBLIC, {role}; "
                   f"SET ROLE {role}; CREATE TABLE t (id int PRIMARY KEY, n int)")
    url = rig.target.url.replace("//postgres@", f"//{role}@")
    try:
        assert rig.tgt("SELECT has_database_privilege(%s, current_database(), 'TEMPORARY')", [role]) == [(False,)]
        rig.publish("t")
        rig.init(target_url=url)
        rig.src("INSERT INTO t SELECT g, 0 FROM generate_series(1, 100) g")
        rig.catchup(target_url=url)  # (an update or delete would fold into the inserts of the same batch)
        rig.src("UPDATE t SET n = id")
        rig.src("DELETE FROM t WHERE id > 60")
        with caplog.at_level(logging.WARNING, logger="applier"):
            rig.catchup(target_url=url)
        assert rig.tgt("SELECT count(*), sum(n) FROM t") == [(60, 60 * 61 // 2)]
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        rig.tgt_script(f"REASSIGN OWNED BY {role} TO postgres; DROP OWNED BY {role}")
        rig.target.cluster.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("target_kind", ["postgresql"], indirect=True)
def test_a_few_inserted_rows_go_as_prepared_inserts_many_by_copy(rig: Rig) -> None:
    """On a PostgreSQL target a source transaction's few inserts into a table are one INSERT each (the start of a
    COPY costs the server as much as some 40 prepared INSERTs), many go by one COPY; both store every row, and a
    row the target refuses among a few is named, nothing of its transaction landing."""
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    # statements that insert into t, counted on the target (a COPY is one)
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v text CHECK (v <> 'bad')); CREATE TABLE stmts (n int); "
                   "CREATE FUNCTION count_stmt() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN INSERT INTO stmts "
                   "VALUES (1); RETURN NULL; END$$; CREATE TRIGGER s AFTER INSERT ON t FOR EACH STATEMENT "
                   "EXECUTE FUNCTION count_stmt(); ALTER TABLE t ENABLE ALWAYS TRIGGER s;")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT g, 'few' FROM generate_series(1, 10) g")
    rig.catchup()
    assert rig.tgt("SELECT count(*) FROM stmts") == [(10,)]
    rig.src("INSERT INTO t SELECT g, 'many' FROM generate_series(101, 400) g")
    rig.catchup()
    assert rig.tgt("SELECT count(*) FROM stmts") == [(11,)]
    assert_same(rig, "SELECT id, v FROM t")
    rig.src("INSERT INTO t SELECT g, CASE WHEN g = 503 THEN 'bad' ELSE 'x' END FROM generate_series(501, 505) g")
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    assert str(err.value).startswith("INSERT on table public.t (key (id)=(503))"), err.value
    assert rig.tgt("SELECT count(*) FROM t WHERE id > 500") == [(0,)]


def test_replica_identity_nothing_with_insert_only_publication(rig: Rig) -> None:
    """Identity NOTHING replicates inserts. Its updates and deletes cannot reach the applier at all:
    with publish='insert' they are not sent, and once the publication publishes updates the source
    itself refuses the UPDATE (the engine's own error is tested in test_skip_and_errors.py)."""
    rig.both("CREATE TABLE t (id int, v text)")
    rig.src("ALTER TABLE t REPLICA IDENTITY NOTHING")
    rig.publish("t", options="publish = 'insert'")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    rig.src("UPDATE t SET v = 'changed' WHERE id = 1")
    rig.src("DELETE FROM t WHERE id = 2")
    rig.src("INSERT INTO t VALUES (3, 'c')")
    rig.catchup()
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "a"), (2, "b"), (3, "c")]
    rig.src("ALTER PUBLICATION pub SET (publish = 'insert, update, delete')")
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="replica identity"):
        rig.src("UPDATE t SET v = 'again' WHERE id = 1")


# -- columns and relations -----------------------------------------------------------


def test_columns_match_by_name_and_extra_target_columns_keep_defaults(rig: Rig) -> None:
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt_script("CREATE TABLE t (extra text DEFAULT 'dflt', v text, n int DEFAULT 7, id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    rig.src("UPDATE t SET v = 'B' WHERE id = 2")
    rig.catchup()
    assert rig.tgt("SELECT id, v, extra, n FROM t ORDER BY id") == [(1, "a", "dflt", 7), (2, "B", "dflt", 7)]


def test_source_column_missing_on_target_is_an_error_naming_table_column_and_lsn(rig: Rig) -> None:
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text, added text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    before = rig.wal_lsn()
    rig.src("INSERT INTO t VALUES (1, 'a', 'x')")
    after = rig.wal_lsn()
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    msg = str(err.value)
    assert "\n" not in msg
    assert "'added'" in msg and "public.t" in msg
    lsns = [LSN.parse(x) for x in LSN_IN_TEXT.findall(msg)]
    assert lsns and all(before <= x <= after for x in lsns), msg
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]
    rig.tgt_script("ALTER TABLE t ADD COLUMN added text")  # the fix: the next run reads the columns again
    rig.catchup()
    assert rig.tgt("SELECT id, v, added FROM t") == [(1, "a", "x")]


def test_new_relation_message_replaces_the_cached_one(rig: Rig) -> None:
    """Columns added and dropped on the source between transactions applied in one run."""
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v text DEFAULT 'v gone', w text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a')")
    rig.src("ALTER TABLE t ADD COLUMN w text")
    rig.src("INSERT INTO t VALUES (2, 'b', 'w2')")
    rig.src("UPDATE t SET w = 'w1' WHERE id = 1")
    rig.src("ALTER TABLE t DROP COLUMN v")
    rig.src("INSERT INTO t VALUES (3, 'w3')")
    rig.catchup()
    assert rig.tgt("SELECT id, v, w FROM t ORDER BY id") == [(1, "a", "w1"), (2, "b", "w2"), (3, "v gone", "w3")]


def test_target_altered_while_running_is_read_again_on_the_next_relation_message(rig: Rig) -> None:
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    stop = threading.Event()
    errors: list[BaseException] = []
    runner = Runner(rig.cfg(apply_group_commit_delay=0.0), catchup=False, stop=stop)

    def daemon() -> None:
        try:
            runner.run()
        except BaseException as exc:  # noqa: BLE001 - reported by wait_for
            errors.append(exc)

    thread = threading.Thread(target=daemon, daemon=True)
    thread.start()
    try:
        rig.src("INSERT INTO t VALUES (1, 'a')")
        wait_for(lambda: rig.tgt("SELECT v FROM t WHERE id = 1") == [("a",)], "the first row", errors=errors)
        rig.tgt_script("ALTER TABLE t ADD COLUMN w text")  # the target first, while the applier runs
        rig.src("ALTER TABLE t ADD COLUMN w text")
        rig.src("INSERT INTO t VALUES (2, 'b', 'new column')")
        wait_for(lambda: rig.tgt("SELECT v, w FROM t WHERE id = 2") == [("b", "new column")], "the second row",
                 errors=errors)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and not errors


def test_user_defined_type_values(rig: Rig) -> None:
    """An enum column: the source sends a Type message; the value arrives as the enum's label."""
    rig.src("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    if rig.kind == "postgresql":
        rig.tgt_script("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    rig.both("CREATE TABLE t (id int PRIMARY KEY, m mood)", "CREATE TABLE t (id int PRIMARY KEY, m text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'ok'), (2, 'sad')")
    rig.src("UPDATE t SET m = 'happy' WHERE id = 2")
    assert any(m["type"] == "Type" and m["name"] == "mood" for m in rig.peek())
    rig.catchup()
    assert rig.tgt("SELECT id, m::text FROM t ORDER BY id" if rig.kind == "postgresql"
                   else "SELECT id, m FROM t ORDER BY id") == [(1, "ok"), (2, "happy")]


# -- names ----------------------------------------------------------------------------


def test_quoted_names_replicate(rig: Rig) -> None:
    """Capitals, spaces, double quotes and reserved words in schema, table and column names."""
    cols = '("Id" int PRIMARY KEY, "Select" text, "a b" text, "we""ird" text, "order" int)'
    rig.both(f'CREATE TABLE "Order Items" {cols}')
    rig.src('CREATE SCHEMA "My Schema"')
    if rig.kind == "postgresql":
        rig.tgt_script('CREATE SCHEMA "My Schema"')
    rig.both('CREATE TABLE "My Schema"."Tbl" ("Key" int PRIMARY KEY, "Value" text)',
             'CREATE TABLE "My Schema.Tbl" ("Key" int PRIMARY KEY, "Value" text)')
    rig.publish('"Order Items"', '"My Schema"."Tbl"')
    rig.init()
    rig.src("""INSERT INTO "Order Items" VALUES (1, 's1', 'ab1', 'w''1', 1), (2, 's2', 'ab2', 'w"2', 2),
                                                 (3, 's3', NULL, NULL, 3)""")
    rig.src("""UPDATE "Order Items" SET "Select" = 'S2', "we""ird" = 'changed' WHERE "Id" = 2""")
    rig.src("""UPDATE "Order Items" SET "Id" = 30 WHERE "Id" = 3""")
    rig.src("""DELETE FROM "Order Items" WHERE "Id" = 1""")
    rig.src("""INSERT INTO "My Schema"."Tbl" VALUES (1, 'one'), (2, 'two'); UPDATE "My Schema"."Tbl" SET "Value" = 'ONE'
               WHERE "Key" = 1; DELETE FROM "My Schema"."Tbl" WHERE "Key" = 2""")
    rig.catchup()
    assert rig.tgt('SELECT "Id", "Select", "a b", "we""ird", "order" FROM "Order Items" ORDER BY "Id"') == [
        (2, "S2", "ab2", "changed", 2), (30, "s3", None, None, 3)]
    other = '"My Schema"."Tbl"' if rig.kind == "postgresql" else '"My Schema.Tbl"'
    assert rig.tgt(f'SELECT "Key", "Value" FROM {other}') == [(1, "ONE")]


def test_schemas_and_target_tables_mapping(rig: Rig) -> None:
    """Schema sales keeps its name (SQLite: one table named "sales.orders"); target.tables renames."""
    rig.src("CREATE SCHEMA sales")
    if rig.kind == "postgresql":
        rig.tgt_script("CREATE SCHEMA sales; CREATE SCHEMA archive; "
                       "CREATE TABLE archive.renamed (id int PRIMARY KEY, v text)")
        mapping = {"public.src": "archive.renamed"}
        renamed = "archive.renamed"
    else:
        rig.tgt_script("CREATE TABLE renamed (id int PRIMARY KEY, v text)")
        mapping = {"public.src": "renamed"}
        renamed = "renamed"
    rig.both("CREATE TABLE sales.orders (id int PRIMARY KEY, v text)",
             'CREATE TABLE "sales.orders" (id int PRIMARY KEY, v text)')
    rig.both("CREATE TABLE src (id int PRIMARY KEY, v text)")  # the unmapped name exists too, and stays empty
    rig.publish("sales.orders", "src")
    rig.init()
    rig.src("INSERT INTO sales.orders VALUES (1, 'o1'), (2, 'o2'); INSERT INTO src VALUES (1, 's1'), (2, 's2')")
    rig.src("UPDATE sales.orders SET v = 'O2' WHERE id = 2; DELETE FROM src WHERE id = 1")
    rig.catchup(target_tables=mapping)
    orders = "sales.orders" if rig.kind == "postgresql" else '"sales.orders"'
    assert rig.tgt(f"SELECT id, v FROM {orders} ORDER BY id") == [(1, "o1"), (2, "O2")]
    assert rig.tgt(f"SELECT id, v FROM {renamed} ORDER BY id") == [(2, "s2")]
    assert rig.tgt("SELECT count(*) FROM src") == [(0,)]


# -- truncate -------------------------------------------------------------------------


def test_truncate_honours_cascade_and_restart_identity(rig: Rig) -> None:
    """PostgreSQL: CASCADE empties a target-only table referencing the truncated one, RESTART IDENTITY
    resets the target's sequence, a plain TRUNCATE keeps it. SQLite has neither foreign-key cascades
    nor sequences: RESTART IDENTITY resets the AUTOINCREMENT counter, a plain TRUNCATE keeps it."""
    ddl = "CREATE TABLE {} (id int GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, v text)"
    for name in ("parent", "plain"):
        rig.both(ddl.format(name), f"CREATE TABLE {name} (id INTEGER PRIMARY KEY AUTOINCREMENT, v text)")
    if rig.kind == "postgresql":
        rig.tgt_script("CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent)")  # target only
    rig.publish("parent", "plain")
    rig.init()
    rig.src("INSERT INTO parent (v) VALUES ('a'), ('b'), ('c'); INSERT INTO plain (v) VALUES ('a'), ('b')")
    rig.catchup()
    if rig.kind == "postgresql":
        rig.tgt_script("INSERT INTO child VALUES (1, 1), (2, 2); "
                       "SELECT setval(pg_get_serial_sequence('parent', 'id'), 100); "
                       "SELECT setval(pg_get_serial_sequence('plain', 'id'), 100)")
    else:
        assert rig.tgt("SELECT name, seq FROM sqlite_sequence ORDER BY name") == [("parent", 3), ("plain", 2)]
    rig.src("TRUNCATE parent RESTART IDENTITY CASCADE")
    rig.src("TRUNCATE plain")
    rig.src("INSERT INTO parent (v) VALUES ('after')")
    rig.catchup()
    assert rig.tgt("SELECT id, v FROM parent") == [(1, "after")]
    assert rig.tgt("SELECT count(*) FROM plain") == [(0,)]
    if rig.kind == "postgresql":
        assert rig.tgt("SELECT count(*) FROM child") == [(0,)]  # emptied by CASCADE
        assert rig.tgt("SELECT last_value, is_called FROM parent_id_seq") == [(1, False)]  # RESTART IDENTITY
        assert rig.tgt("SELECT last_value, is_called FROM plain_id_seq") == [(100, True)]  # plain TRUNCATE: kept
    else:
        assert rig.tgt("SELECT name, seq FROM sqlite_sequence ORDER BY name") == [("parent", 1), ("plain", 2)]


# -- origins and messages ---------------------------------------------------------------


def test_skip_origins(rig: Rig) -> None:
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("SELECT pg_replication_origin_create(o) FROM unnest(ARRAY['node_a', 'node_b']) o "
            "WHERE pg_replication_origin_oid(o) IS NULL")  # origins are cluster-wide
    rig.src("INSERT INTO t VALUES (1, 'local')")
    for node, rows in (("node_a", "(2, 'from a'), (3, 'from a')"), ("node_b", "(4, 'from b')")):
        with rig.src_conn() as conn:
            conn.execute("SELECT pg_replication_origin_session_setup(%s)", [node])
            conn.execute(f"INSERT INTO t VALUES {rows}")
            conn.execute("SELECT pg_replication_origin_session_reset()")
    rig.src("INSERT INTO t VALUES (5, 'local again')")
    summary = rig.catchup(apply_skip_origins=["node_a"])
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "local"), (4, "from b"), (5, "local again")]
    assert summary.skipped == 1 and summary.transactions == 3


def test_logical_decoding_messages_are_logged_not_applied(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a'); SELECT pg_logical_emit_message(true, 'audit', 'INSERT INTO t VALUES (9)')")
    rig.src("SELECT pg_logical_emit_message(false, 'heartbeat', 'ping')")
    rig.src("INSERT INTO t VALUES (2, 'b')")
    with caplog.at_level(logging.INFO, logger="applier"):
        summary = rig.catchup()
    logged = [r.getMessage() for r in caplog.records if "logical decoding message" in r.getMessage()]
    assert len(logged) == 2
    assert "prefix='audit'" in logged[0] and "24 bytes" in logged[0] and "non-transactional" not in logged[0]
    assert "prefix='heartbeat'" in logged[1] and "non-transactional" in logged[1]
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "a"), (2, "b")]
    assert summary.transactions == 2


# -- progress, status, init --------------------------------------------------------------------


def test_a_message_in_a_group_applied_again_is_logged_once(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A conflict rolls back the group (several source transactions) and applies it again one transaction at a
    time: a logical decoding message in it is logged when it commits, once."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    rig.catchup()
    rig.tgt("DELETE FROM t WHERE id = 2")  # the source's delete will not find it: a conflict
    rig.src("SELECT pg_logical_emit_message(true, 'audit', 'before')")
    rig.src("DELETE FROM t WHERE id = 2")
    rig.src("INSERT INTO t VALUES (3, 'c'); SELECT pg_logical_emit_message(true, 'audit', 'after')")
    with caplog.at_level(logging.INFO, logger="applier"):
        assert rig.catchup().transactions == 3
    logged = [r.getMessage() for r in caplog.records if "logical decoding message" in r.getMessage()]
    assert len(logged) == 2 and "6 bytes" in logged[0] and "5 bytes" in logged[1], logged
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "a"), (3, "c")]


def test_a_source_of_another_cluster_is_refused_before_anything_is_applied(rig: Rig, pg_target: Cluster) -> None:
    """LSNs belong to one cluster's WAL: progress recorded from one source means nothing on another."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1)")
    rig.catchup()
    (system,), = rig.src("SELECT system_identifier::text FROM pg_control_system()")
    with scratch_db(pg_target, "other") as other:  # another cluster, same names
        other.cluster.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t", other.dbname)
        rig.init(source_dsn=other.dsn)
        other.cluster.execute("INSERT INTO t SELECT g FROM generate_series(2, 50) g", other.dbname)
        (other_system,), = other.cluster.execute("SELECT system_identifier::text FROM pg_control_system()")
        assert other_system != system
        with pytest.raises(ConfigError) as err:
            rig.catchup(source_dsn=other.dsn)
        msg = str(err.value)
        assert f"the source is PostgreSQL system {other_system}" in msg and f"recorded from system {system}" in msg
        assert "\n" not in msg
    assert rig.tgt("SELECT id FROM t") == [(1,)]
    rig.src("INSERT INTO t VALUES (3)")  # the cluster the progress came from still applies
    rig.catchup()
    assert rig.tgt("SELECT id FROM t ORDER BY id") == [(1,), (3,)]


def test_status_shows_applied_lsn_and_slot_confirms_no_further(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    created = rig.slot_confirmed()
    rig.src("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 100) g")
    rig.src("UPDATE t SET v = 'changed' WHERE id <= 10")
    last = rig.wal_lsn()
    summary = rig.catchup()
    applied = rig.progress_lsn()
    assert applied == summary.applied and applied >= last  # the end LSN of the UPDATE's transaction
    confirmed = rig.slot_confirmed()
    assert created < confirmed <= applied
    out = run_cli("status", "-c", str(rig.config_file()))
    assert out.returncode == 0, out.stderr
    info = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert info["applied_lsn"] == str(applied)
    assert LSN.parse(info["slot_confirmed_lsn"]) <= applied
    assert info["slot_exists"] == "True" and info["skip_lsn"] == "-"


def test_init_is_idempotent_and_says_what_it_did(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    cfg = str(rig.config_file())
    first = run_cli("init", "-c", cfg)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("control tables: created at ")
    assert re.fullmatch(rf"slot '{rig.slot}': created at [0-9A-F]+/[0-9A-F]+", lines[1])
    revision = lines[0].rsplit(" ", 1)[1]
    assert rig.src("SELECT plugin FROM pg_replication_slots WHERE slot_name = %s", [rig.slot]) == [("pgoutput",)]
    rig.src("INSERT INTO t VALUES (1)")
    assert rig.catchup().transactions == 1
    again = run_cli("init", "-c", cfg)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"control tables: already at {revision}",
        f"slot '{rig.slot}': exists (confirmed up to {rig.slot_confirmed()})",
    ]
    assert rig.progress_lsn() > LSN(0)  # the progress survived the second init
    assert rig.src("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", [rig.slot]) == [(1,)]
