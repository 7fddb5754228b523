"""Changes held for a table being copied (``applier.engine.holding``): the stream goes on for the other tables.

What a user relies on: while ``applier sync --table`` copies a table (its applier_sync_tables row 'copying' at the
copy's snapshot S), the other tables' changes are applied as they come; the copied table's changes committed at or
after S are kept on the target (applier_held) in their own target transactions, survive a restart, and once the row
is 'ready' are applied in commit order (inserts, updates, deletes, a TRUNCATE of it with another table, a column
added on the way), so the table ends equal to the source; those committed before S are in the copy and never
applied. The row's states are written here as ``sync --table`` writes them; the copy itself is the test's own
INSERT of the rows the snapshot sees (the Spark copy is tested in tests/spark/test_add_table.py).

How each test fails without holding: the engine waits (``TableWait``) at the first change of the copied table, so
the other table's rows after it are not applied and nothing is in applier_held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from applier.admin import status
from applier.engine.apply import ApplyEngine
from applier.lsn import LSN
from applier.source import capture

from .conftest import Rig
from .test_ddl_follow import target_columns


@contextmanager
def fed_engine(rig: Rig, **kw: Any) -> Iterator[ApplyEngine]:
    """An engine as `applier run` makes it (it waits for copies) that has applied the slot's pending messages (as the
    runner hands them over, then idle); closed at the end."""
    msgs = rig.received()
    engine = rig.engine(wait_for_tables=True, **kw)
    try:
        for msg, raw in msgs:
            engine.handle(msg, raw)
        engine.idle()
        yield engine
    finally:
        engine.close()
        engine.target.close()


def set_join(rig: Rig, state: str, at: LSN | None) -> None:
    """The applier_sync_tables row of public.n, as `applier sync --table` writes it."""
    rig.tgt("DELETE FROM applier_sync_tables WHERE table_name = 'n'")
    rig.tgt("INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run, snapshot_lsn, started_at) "
            + ("VALUES (%s, %s, %s, %s, %s, %s, %s)" if rig.target is not None else "VALUES (?, ?, ?, ?, ?, ?, ?)"),
            ["applier", "public", "n", state, "r1", str(at) if at is not None else None, "2026-11-27T00:00:00Z"])


def test_a_table_being_copied_is_held_and_the_others_flow(rig: Rig) -> None:
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE n (id int PRIMARY KEY, v text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE n (id int PRIMARY KEY, v text, w text)")
    rig.publish("t", "n")
    rig.init()
    rig.src("BEGIN; INSERT INTO n VALUES (1, 'a'), (2, 'b'); INSERT INTO t VALUES (1, 'x'); COMMIT")
    at = rig.wal_lsn()  # the copy's snapshot: it sees n (1, 'a'), (2, 'b')
    rig.tgt("INSERT INTO n (id, v) VALUES (1, 'a'), (2, 'b')")
    set_join(rig, "copying", at)
    rig.src("BEGIN; INSERT INTO t VALUES (2, 'y'); UPDATE n SET v = 'b2' WHERE id = 2; INSERT INTO n VALUES (3, 'c');"
            " COMMIT")
    rig.src("BEGIN; ALTER TABLE n ADD COLUMN w text; INSERT INTO n VALUES (4, 'd', 'w4'); DELETE FROM n WHERE id = 1;"
            " INSERT INTO t VALUES (3, 'z'); COMMIT")
    rig.src("BEGIN; TRUNCATE n, t; INSERT INTO n VALUES (5, 'e', 'w5'); INSERT INTO t VALUES (4, 'q'); COMMIT")
    rig.src("BEGIN; INSERT INTO n VALUES (6, 'f', 'w6'); UPDATE n SET w = 'w5+' WHERE id = 5; COMMIT")
    with fed_engine(rig, schema_changes="add_columns") as engine:
        assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(4, "q")]  # t applied through the copy of n
        assert rig.tgt("SELECT id, v, w FROM n ORDER BY id") == [(1, "a", None), (2, "b", None)]  # n: the copy only
        held = rig.tgt("SELECT table_name, count(*) FROM applier_held GROUP BY table_name")
        assert held == [("n", 4)], held  # the four transactions after the snapshot
        assert engine.applied == engine.last_commit_end
    assert status(rig.cfg())["held"] == [{"table": "public.n", "transactions": 4}]  # what an operator sees
    again = rig.engine(schema_changes="add_columns", wait_for_tables=True)  # a restart: what is held is found on the target
    try:
        assert [t.table for t in again.holding.tables.values()] == ["n"]
        again.poll_held()  # still copying: nothing applied
        assert rig.tgt("SELECT count(*) FROM applier_held") == [(4,)]
        set_join(rig, "ready", at)
        position = rig.progress_lsn()
        oid = next(iter(again.holding.tables))
        assert again.drain(oid, limit=3)  # a step: three of the four, committed; the table stays held
        again.flush_group()
        assert rig.tgt("SELECT count(*) FROM applier_held") == [(1,)]
        assert again.holding.tables
        assert not again.poll_held()  # the last one
        again.flush_group()
        assert not again.holding.tables
        assert rig.progress_lsn() == position  # a drain moves the applied position neither way
    finally:
        again.close()
        again.target.close()
    want = rig.src("SELECT id, v, w FROM n ORDER BY id")
    assert want == [(5, "e", "w5+"), (6, "f", "w6")]
    assert rig.tgt("SELECT id, v, w FROM n ORDER BY id") == want
    assert rig.tgt("SELECT count(*) FROM applier_held") == [(0,)]


def test_changes_before_the_snapshot_are_skipped_at_the_drain(rig: Rig) -> None:
    """A row 'init' (no snapshot yet) holds every change; at the drain, those committed before the snapshot the
    copy took meanwhile are skipped (they are in the copy): applied again, the insert would collide."""
    rig.both("CREATE TABLE n (id int PRIMARY KEY, v text)")
    rig.publish("n")
    rig.init()
    set_join(rig, "init", None)
    rig.src("INSERT INTO n VALUES (1, 'before')")
    with fed_engine(rig) as engine:
        assert rig.tgt("SELECT count(*) FROM applier_held") == [(1,)]
        at = rig.wal_lsn()  # the copy's snapshot, taken after the insert: the copy has it
        rig.tgt("INSERT INTO n VALUES (1, 'before')")
        set_join(rig, "ready", at)
        engine.poll_held()
        engine.flush_group()
    assert rig.tgt("SELECT id, v FROM n") == [(1, "before")]
    assert rig.tgt("SELECT count(*) FROM applier_held") == [(0,)]


def test_captured_ddl_of_a_table_being_copied_is_held_with_its_rows(rig: Rig) -> None:
    """With DDL capture, a column added to the table being copied is held with the rows around it and added at
    the drain (the target table is not altered under the running copy); the other table's DDL is applied as it
    comes."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE n (id int PRIMARY KEY, v text)")
    rig.publish("t", "n")
    capture.install(rig.source.dsn)
    rig.init()
    rig.src("ALTER TABLE n ALTER COLUMN v SET STATISTICS 100; ALTER TABLE t ALTER COLUMN v SET STATISTICS 100")
    with fed_engine(rig, schema_changes="follow"):
        pass  # the shapes known from capture, applied
    at = rig.wal_lsn()
    set_join(rig, "copying", at)
    rig.src("BEGIN; INSERT INTO n VALUES (3, 'c'); ALTER TABLE n ADD COLUMN w text; INSERT INTO n VALUES (4, 'd', 'w4');"
            " ALTER TABLE t ADD COLUMN x int; INSERT INTO t VALUES (1, 'a', 7); COMMIT")
    with fed_engine(rig, schema_changes="follow") as engine:
        assert rig.tgt("SELECT id, v, x FROM t") == [(1, "a", 7)]  # t's DDL and row: applied
        assert target_columns(rig, "n") == ["id", "v"]  # n: untouched while it is copied
        set_join(rig, "ready", at)
        engine.poll_held()
        engine.flush_group()
    assert target_columns(rig, "n") == ["id", "v", "w"]
    assert rig.tgt("SELECT id, v, w FROM n ORDER BY id") == rig.src("SELECT id, v, w FROM n ORDER BY id")
    assert rig.tgt("SELECT ddl_class, result FROM applier_ddl_log WHERE table_name = 'public.n'") == [
        ("add_column", "applied")]
