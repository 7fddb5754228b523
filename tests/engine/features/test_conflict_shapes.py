"""Conflict handling on the table and statement shapes it must get right (issue 16 item 3).

Partial unique indexes, partitioned targets, SQLite tables WITHOUT ROWID or with an INTEGER PRIMARY KEY, a
column named like the lookup's alias, REPLICA IDENTITY FULL and every set-based statement under the origin
guard, binary mode, ALWAYS identity columns, prepared and streamed transactions, and conflicts met again later
in one run. Each test says what a user would see.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.plugins.cli import run_cli

from .conftest import Rig
from .test_conflicts import recorded, src_txn, ts_rig  # noqa: F401 - ts_rig: a fixture
from .test_observability import by_label, daemon, free_port, scrape, scrape_until


def test_partial_unique_index_is_no_collision(rig: Rig) -> None:
    """A row outside a partial unique index's predicate collides with nothing: an insert colliding on the key
    alone is insert_exists, and apply_remote must not delete the unrelated local row."""
    rig.both("CREATE TABLE p (id int PRIMARY KEY, email text, active int)")
    rig.tgt("CREATE UNIQUE INDEX p_email_active ON p (email) WHERE active = 1")
    rig.publish("p")
    rig.init()
    rig.tgt("INSERT INTO p VALUES (1, 'x', 0), (10, 'a', 0)")  # row 10 is inactive: outside the index
    rig.src("INSERT INTO p VALUES (1, 'a', 1)")  # collides with local row 1 on the key only
    rig.catchup(conflicts_insert_exists="apply_remote", conflicts_multiple_unique_conflicts="apply_remote")
    rows = recorded(rig)
    assert rig.tgt("SELECT id, email, active FROM p ORDER BY id") == [(1, "a", 1), (10, "a", 0)], rows
    assert [r.type for r in rows] == ["insert_exists"], rows


@pytest.mark.parametrize("target_kind", ["postgresql"])
def test_partitioned_target_update_exists_deletes_only_the_colliding_row(rig: Rig) -> None:
    """A partitioned target table: row ids (ctid) repeat in each partition, so a row found by ctid through the
    parent is not one row."""
    rig.src("CREATE TABLE pt (id int PRIMARY KEY, v text)")
    rig.tgt_script("CREATE TABLE pt (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); "
                   "CREATE TABLE pt1 PARTITION OF pt FOR VALUES FROM (0) TO (100); "
                   "CREATE TABLE pt2 PARTITION OF pt FOR VALUES FROM (100) TO (200)")
    rig.publish("pt")
    rig.init()
    rig.src("INSERT INTO pt VALUES (1, 's1'), (3, 's3'), (101, 's101'), (102, 's102'), (103, 's103')")
    rig.catchup()
    rig.tgt("INSERT INTO pt VALUES (2, 'local')")  # pt1's third row: ctid (0,3), as 103's in pt2
    assert rig.tgt("SELECT ctid::text FROM pt WHERE id IN (2, 103) ORDER BY id") == [("(0,3)",), ("(0,3)",)]
    rig.src("UPDATE pt SET id = 2 WHERE id = 3")  # update_exists with local row 2
    rig.catchup(conflicts_update_exists="apply_remote")
    assert [r.type for r in recorded(rig)] == ["update_exists"]
    assert rig.tgt("SELECT id, v FROM pt ORDER BY id") == [(1, "s1"), (2, "s3"), (101, "s101"), (102, "s102"),
                                                           (103, "s103")]


def test_update_missing_apply_remote_whose_row_collides(rig: Rig) -> None:
    """update_missing resolved by apply_remote inserts the row; when that row collides with another local row
    the apply must not stop with a bare unique violation (the conflict is classified and its policy applied)."""
    rig.both("CREATE TABLE u (id int PRIMARY KEY, code text UNIQUE, v text)")
    rig.publish("u")
    rig.init()
    rig.src("INSERT INTO u VALUES (1, 'a', 's1')")
    rig.catchup()
    rig.tgt("DELETE FROM u WHERE id = 1")
    rig.tgt("INSERT INTO u VALUES (9, 'z', 'local9')")
    src_txn(rig, "UPDATE u SET code = 'z' WHERE id = 1")
    rig.catchup(conflicts_update_missing="apply_remote", conflicts_insert_exists="skip",
                conflicts_update_exists="skip")
    assert "update_missing" in [r.type for r in recorded(rig)]


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_later_conflicts_are_no_errors_either(cli_rig: Rig) -> None:
    """Conflicts met by a running daemon are resolved, not failures: applier_errors_total stays at 0 and no
    'apply failed' warning is logged, for the second conflict as for the first."""
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 10) g")
    rig.catchup()
    rig.tgt("DELETE FROM t WHERE id IN (1, 2)")
    port = free_port()
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}")
    with daemon(rig, config) as (proc, err):
        rig.src("DELETE FROM t WHERE id = 1")
        scrape_until(port, "one conflict", lambda m: sum(by_label(m, "applier_conflicts_total", "type").values())
                     == 1, proc, err)
        rig.src("UPDATE t SET v = 'w' WHERE id = 5")  # an ordinary transaction between
        time.sleep(1.5)
        rig.src("DELETE FROM t WHERE id = 2")
        done = scrape_until(port, "two conflicts", lambda m: sum(
            by_label(m, "applier_conflicts_total", "type").values()) == 2, proc, err)
        time.sleep(0.5)
        done = scrape(port)
    log = err.read_text()
    errors = by_label(done, "applier_errors_total", "kind")
    assert not errors and "apply failed" not in log, (errors, log)


def test_origin_guard_on_every_statement_shape(ts_rig: Rig) -> None:  # noqa: F811 - the fixture
    """Set-based UPDATE (unnest) and DELETE (= ANY, and unnest for a composite key), each meeting rows changed
    on the target: each such row is one *_origin_differs, every
    other row applied once."""
    rig = ts_rig
    rig.both("CREATE TABLE a (id int PRIMARY KEY, v text)")
    rig.both("CREATE TABLE c (k1 int, k2 int, v text, PRIMARY KEY (k1, k2))")
    rig.publish("a", "c")
    rig.init()
    rig.src("INSERT INTO a SELECT g, 's' FROM generate_series(1, 40) g")
    rig.src("INSERT INTO c SELECT g, g, 's' FROM generate_series(1, 40) g")
    rig.catchup()
    assert recorded(rig) == []
    rig.tgt("UPDATE a SET v = 'local' WHERE id IN (5, 25, 35)")
    rig.tgt("UPDATE c SET v = 'local' WHERE k1 IN (7, 27)")
    rig.src("UPDATE a SET v = 'r' WHERE id <= 30")  # a batch of 30: one UPDATE … FROM unnest
    rig.src("DELETE FROM a WHERE id > 30")  # a batch of 10: one DELETE … = ANY
    rig.src("DELETE FROM c WHERE k1 <= 30")  # composite key: DELETE … USING unnest
    rig.catchup(conflicts_update_origin_differs="keep_local", conflicts_delete_origin_differs="keep_local")
    got = sorted((r.type, r.table, r.key, r.resolution) for r in recorded(rig))
    assert rig.tgt("SELECT id, v FROM a ORDER BY id") == (
        [(i, "local" if i in (5, 25) else "r") for i in range(1, 31)] + [(35, "local")]), got
    assert rig.tgt("SELECT k1, v FROM c ORDER BY k1") == [(7, "local"), (27, "local")] + [
        (i, "s") for i in range(31, 41)], got
    kinds = [(t, tab) for t, tab, _, _ in got]
    assert kinds.count(("update_origin_differs", "public.a")) == 2, got
    assert kinds.count(("delete_origin_differs", "public.a")) == 1, got
    assert kinds.count(("delete_origin_differs", "public.c")) == 2, got
    assert len(got) == 5, got


def test_binary_mode_conflicts(rig: Rig) -> None:
    """source.binary = true: the row is found and recorded as with text."""
    rig.both("CREATE TABLE b (id bigint PRIMARY KEY, n numeric, ts timestamptz, d bytea, code text UNIQUE)")
    rig.publish("b")
    rig.init(source_binary=True)
    rig.src("INSERT INTO b VALUES (1, 1.5, '2024-01-02 03:04:05+00', '\\x0102', 'a'), "
            "(2, 2.5, '2024-01-02 03:04:05+00', '\\x03', 'b')")
    rig.catchup(source_binary=True)
    rig.tgt("DELETE FROM b WHERE id = 1")
    rig.tgt("INSERT INTO b (id, n, code) VALUES (3, 9, 'local')")
    policies = {"conflicts_update_missing": "apply_remote", "conflicts_insert_exists": "apply_remote"}
    for change in ("UPDATE b SET n = 7.25 WHERE id = 1",  # each on its own: see the test after the next
                   "INSERT INTO b VALUES (3, 3.5, '2024-01-02 03:04:05+00', '\\x04', 'c')",
                   "UPDATE b SET code = 'c2', n = 8 WHERE id = 2"):
        rig.src(change)
        rig.catchup(source_binary=True, **policies)
    got = recorded(rig)
    assert sorted(r.type for r in got) == ["insert_exists", "update_missing"], got
    assert [(r[0], float(r[1]), r[2]) for r in rig.tgt("SELECT id, n, code FROM b ORDER BY id")] == [
        (1, 7.25, "a"), (2, 8.0, "c2"), (3, 3.5, "c")], got
    ins = next(r for r in got if r.type == "insert_exists")
    assert ins.remote["code"] == "c" and ins.local["code"] == "local", ins


def test_error_policy_on_update_exists_names_the_row(rig: Rig, tmp_path: Path) -> None:
    """A key-changing update colliding with another local row, conflicts.update_exists = "error": one line
    naming the type, table and key; nothing of the transaction applied."""
    rig.both("CREATE TABLE k (id int PRIMARY KEY, v text)")
    rig.publish("k")
    rig.init()
    rig.src("INSERT INTO k VALUES (1, 'one')")
    rig.catchup()
    rig.tgt("INSERT INTO k VALUES (2, 'local')")
    src_txn(rig, "INSERT INTO k VALUES (5, 'five')", "UPDATE k SET id = 2 WHERE id = 1")
    r = run_cli("catchup", "-c", str(rig.config_file()))
    assert r.returncode != 0
    line = r.stderr.strip().splitlines()[-1]
    assert "update_exists" in line and "(id)=" in line and "Traceback" not in r.stderr, r.stderr
    assert rig.tgt("SELECT id, v FROM k ORDER BY id") == [(1, "one"), (2, "local")]


@pytest.mark.parametrize("target_kind", ["postgresql"])
def test_conflict_after_several_changes_in_one_transaction(rig: Rig) -> None:
    """A transaction of several changes, then one that collides (insert_exists = skip): resolved, committed.
    (psycopg prepares a statement run 5 times and answers any ROLLBACK, ROLLBACK TO SAVEPOINT too, with
    DEALLOCATE ALL, which also drops the statements the commit pipeline prepared on the session.)"""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.tgt("INSERT INTO t VALUES (9, 'local')")
    src_txn(rig, *[f"INSERT INTO t VALUES ({i}, 'r')" for i in range(1, 9)])  # committed in careful mode first
    src_txn(rig, "INSERT INTO t VALUES (9, 'r')")
    rig.catchup(conflicts_insert_exists="skip")
    assert rig.tgt("SELECT count(*) FROM t") == [(9,)]
    assert [r.type for r in recorded(rig)] == ["insert_exists"]


@pytest.mark.parametrize("target_kind", ["postgresql"])
def test_table_with_a_column_named_x(rig: Rig) -> None:
    """A conflict on a table with a column named x (find_sql aliases the table x: row_to_json(x) is the column)."""
    rig.both("CREATE TABLE pt (id int PRIMARY KEY, x int, y int)")
    rig.publish("pt")
    rig.init()
    rig.tgt("INSERT INTO pt VALUES (1, 10, 10)")
    rig.src("INSERT INTO pt VALUES (1, 1, 1)")
    rig.catchup(conflicts_insert_exists="apply_remote")
    assert rig.tgt("SELECT id, x, y FROM pt") == [(1, 1, 1)]
    assert [r.type for r in recorded(rig)] == ["insert_exists"]


def test_origin_guard_replica_identity_full(ts_rig: Rig) -> None:  # noqa: F811 - the fixture
    """REPLICA IDENTITY FULL on a target that detects origins: a row changed on the target (same values, a new
    commit) then updated on the source is update_origin_differs, resolved by its policy."""
    rig = ts_rig
    rig.both("CREATE TABLE f (id int, v text)")
    rig.src("ALTER TABLE f REPLICA IDENTITY FULL")
    rig.publish("f")
    rig.init()
    rig.src("INSERT INTO f SELECT g, 's' FROM generate_series(1, 5) g")
    rig.catchup()
    rig.tgt("UPDATE f SET v = v WHERE id = 2")  # FULL finds rows by every value: the same values, a new commit
    rig.src("UPDATE f SET v = 'r' WHERE id IN (2, 3)")
    rig.catchup(conflicts_update_origin_differs="keep_local")
    assert rig.tgt("SELECT id, v FROM f ORDER BY id") == [(1, "s"), (2, "s"), (3, "r"), (4, "s"), (5, "s")]
    assert [(r.type, r.resolution) for r in recorded(rig)] == [("update_origin_differs", "keep_local")]


def test_prepared_and_streamed_transactions_meet_conflicts(rig: Rig) -> None:
    """A prepared transaction (native PREPARE on a PostgreSQL target, applier_prepared on SQLite) and a streamed
    one meeting insert_exists (apply_remote) and update_missing (skip): each resolved and recorded once."""
    extra = {"source_streaming": True, "source_two_phase": True}
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init(**extra)
    rig.src("INSERT INTO t VALUES (2, 's2')")
    rig.catchup(**extra)
    rig.tgt("INSERT INTO t VALUES (1, 'local')")
    rig.tgt("DELETE FROM t WHERE id = 2")
    with rig.src_conn() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (1, 'prepared')")
        conn.execute("UPDATE t SET v = 'u' WHERE id = 2")
        conn.execute("PREPARE TRANSACTION 'review_gx'")
    policies = {**extra, "conflicts_insert_exists": "apply_remote"}
    rig.catchup(**policies)
    rig.src("COMMIT PREPARED 'review_gx'")
    rig.catchup(**policies)
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "prepared")]
    assert sorted(r.type for r in recorded(rig)) == ["insert_exists", "update_missing"]
    rig.tgt("INSERT INTO t VALUES (3000, 'local')")
    rig.src("INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1000, 4000) g")  # streamed
    rig.catchup(**policies)
    assert rig.tgt("SELECT count(*), min(v) FROM t WHERE id >= 1000") == [(3001, "x" * 200)]
    got = recorded(rig)
    assert sorted(r.type for r in got) == ["insert_exists", "insert_exists", "update_missing"], got


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_sqlite_without_rowid_table(rig: Rig) -> None:
    """A SQLite target table WITHOUT ROWID has no rowid to find local rows by."""
    rig.both("CREATE TABLE w (id int PRIMARY KEY, v text)", "CREATE TABLE w (id int PRIMARY KEY, v text) WITHOUT ROWID")
    rig.publish("w")
    rig.init()
    rig.tgt("INSERT INTO w VALUES (1, 'local')")
    rig.src("INSERT INTO w VALUES (1, 'r'), (2, 'r')")
    rig.catchup(conflicts_insert_exists="apply_remote")
    assert rig.tgt("SELECT id, v FROM w ORDER BY id") == [(1, "r"), (2, "r")]
    assert [r.type for r in recorded(rig)] == ["insert_exists"]


@pytest.mark.parametrize("target_kind", ["postgresql"])
def test_always_identity_insert_exists_apply_remote(rig: Rig) -> None:
    """A target key GENERATED ALWAYS AS IDENTITY: apply_remote replaces the local row (delete, insert)."""
    rig.src("CREATE TABLE g (id int PRIMARY KEY, v text)")
    rig.tgt("CREATE TABLE g (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text)")
    rig.publish("g")
    rig.init()
    rig.tgt("INSERT INTO g (v) VALUES ('local')")  # id 1
    rig.src("INSERT INTO g VALUES (1, 'r'), (2, 'r')")
    rig.catchup(conflicts_insert_exists="apply_remote")
    assert rig.tgt("SELECT id, v FROM g ORDER BY id") == [(1, "r"), (2, "r")]
    assert [r.type for r in recorded(rig)] == ["insert_exists"]
