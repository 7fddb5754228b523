"""Sync's states: interrupted and restarted, slot made by ``init``, repeated, refused, mismatched.

What a user relies on: a sync that failed half-way drops its useless slot (and
says so) and is restarted cleanly by the next one, which says so (no row twice,
nothing missing); a partition written
twice in one run is written once; a slot that exists without a completed copy
is dropped and created again, with a message; a completed sync is not repeated
by accident, and not into tables that hold rows; an incompatible target table
is reported by table and column before anything is written. The slot of a
failed copy is dropped once its walsender has exited (that takes a moment after
the connection closes), and said to be kept only if it stays in use. A sync
killed after a table's copy, while its keys are built, leaves it marked as
owing them; the rerun copies it again and builds them (a table the user made
keeps its own indexes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest

from applier.admin import init, read_progress
from applier.config import load_config
from applier.lsn import LSN
from applier.migrate.schema import SchemaError, read_source_tables
from applier.migrate.spark import copy as spark_copy
from applier.migrate.spark.copy import SQLITE_PART_PAGES, copy_partitions
from applier.migrate.spark.pgcopy import COPY_CHUNK, CopyError, CopyPlan, copy_pg_partitions, relay
from applier.migrate.spark.source import pg_plan
from applier.migrate.spark.verify import verify
from applier.migrate.sync import SyncError, _drop_incomplete_slot, sync
from applier.progress.migrate import migrate
from applier.source.base import StreamOptions
from applier.source.walsender import WalSender
from tests.plugins.cli import popen
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config, target_exec
from tests.spark.test_add_table import config_file, wait_for
from tests.spark.test_schema import INDEXES

pytest.importorskip("pyspark")

SOURCE = """
CREATE TABLE a (id int PRIMARY KEY, v text);
INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 20000) g;
CREATE TABLE b (id int PRIMARY KEY, n int NOT NULL);
INSERT INTO b SELECT g, g FROM generate_series(1, 20000) g;
CREATE PUBLICATION pub FOR TABLE a, b;
"""


def _slot(src: ScratchDb, name: str) -> tuple | None:
    rows = src.cluster.execute("SELECT confirmed_flush_lsn::text, active FROM pg_replication_slots "
                               "WHERE slot_name = %s", src.dbname, [name])
    return rows[0] if rows else None


def test_an_interrupted_sync_is_restarted_by_the_next(spark, src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    # b's copy fails half-way: the target refuses rows with n > 15000 (after a's copy is complete)
    target_exec(target_url, "CREATE TABLE b (id integer PRIMARY KEY, n integer NOT NULL CHECK (n <= 15000))")
    cfg = make_config(src, target_url, tmp_path / "work", partitions=4)
    said: list[str] = []
    with pytest.raises(SyncError, match=r"1 of 2 tables could not be copied.*\n  copying public\.b failed: .*(check|CHECK)"):
        sync(cfg, spark=spark, say=said.append)
    assert any("retrying the table once, resuming:" in s and "partitions are already copied" in s for s in said), said
    assert target_exec(target_url, "SELECT count(*) FROM a")[0][0] == 20000
    assert target_exec(target_url, "SELECT state FROM applier_sync")[0][0] == "copying"
    assert read_progress(cfg).lsn == LSN(0)  # run/catchup have nowhere to start from
    # the slot of the incomplete copy is useless (its snapshot is gone) and would hold WAL: dropped, and said
    assert _slot(src, "applier") is None
    assert said[-1] == "slot 'applier' dropped: the copy did not complete; `applier sync` creates it again", said

    src.cluster.execute("INSERT INTO a VALUES (20001, 'after the failure')", src.dbname)
    if target_url.startswith("sqlite"):  # SQLite cannot drop a constraint: recreate the table
        target_exec(target_url, "DROP TABLE b")
    else:
        target_exec(target_url, "ALTER TABLE b DROP CONSTRAINT b_n_check")
    said.clear()
    res = sync(cfg, spark=spark, say=said.append)
    assert res.mode == "restart"
    assert any(s.startswith("restarting the interrupted sync") for s in said), said
    assert {t.table: t.rows for t in res.tables} == {"public.a": 20001, "public.b": 20000}
    assert target_exec(target_url, "SELECT count(*), count(DISTINCT id) FROM a")[0] == (20001, 20001)
    assert read_progress(cfg).lsn == res.consistent_point
    assert LSN.parse(_slot(src, "applier")[0]) == res.consistent_point
    assert verify(cfg, spark=spark).ok


def _plan(src: ScratchDb, target: str, table: str, partitions: int) -> CopyPlan:
    """The copy plan of a source table (the newest snapshot) into the same-named target table (migrated): run 'r' of
    apply.name 'n', recorded in the target's sync row as the copy under way."""
    with psycopg.connect(src.dsn) as conn:
        [t] = [t for t in read_source_tables(conn, ["pub"]) if t.name == table]
    cols = [f'"{c.name}"' for c in t.columns]
    sqlite = target.endswith(".db")
    with contextlib.closing(sqlite3.connect(target)) if sqlite else psycopg.connect(target) as conn:
        conn.execute("INSERT INTO applier_sync (name, state, run) VALUES ('n', 'copying', 'r')")
        conn.commit()
    return CopyPlan(json.loads(pg_plan(src.dsn, t.qname, cols, pages=t.pages, partitions=partitions)),
                    "sqlite" if sqlite else "postgresql", target, f'"{table}"', cols,
                    [c.type_oid for c in t.columns], "n", "r", t.qualified)


def test_the_relay_hands_on_whole_rows_in_chunks_and_raises_the_sources_error(src: ScratchDb) -> None:
    """What a copy task reads from the source's COPY reaches the target whole, in chunks of whole rows; a COPY that
    fails half-way raises the server's error, and the connection stays usable."""
    query = "COPY (SELECT g, repeat('x', 1000) FROM generate_series(1, 3000) g) TO STDOUT"
    with psycopg.connect(src.dsn, autocommit=True) as conn:
        chunks: list[bytes] = []
        rows, nbytes = relay(conn, query, lambda b: chunks.append(bytes(b)))
        want = b"".join(f"{g}\t{'x' * 1000}\n".encode() for g in range(1, 3001))
        assert (rows, nbytes, b"".join(chunks)) == (3000, len(want), want)
        assert len(chunks) > 1 and all(len(c) >= COPY_CHUNK for c in chunks[:-1])
        assert all(c.endswith(b"\n") for c in chunks)
        with pytest.raises(psycopg.errors.DivisionByZero, match="division by zero"):
            relay(conn, "COPY (SELECT 1 / (g - 2000) FROM generate_series(1, 3000) g) TO STDOUT", chunks.append)
        with pytest.raises(psycopg.errors.UndefinedTable):
            relay(conn, "COPY nosuchtable TO STDOUT", chunks.append)
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.parametrize("binary", [False, True])
def test_a_partition_is_written_once(src: ScratchDb, dst: ScratchDb, binary: bool) -> None:
    src.cluster.execute("CREATE TABLE t (id int, v text); INSERT INTO t VALUES (1, 'x'), (2, NULL); "
                        "CREATE PUBLICATION pub FOR TABLE t", src.dbname)
    dst.cluster.execute("CREATE TABLE t (id int, v text)", dst.dbname)
    migrate(dst.url)
    plan = _plan(src, dst.dsn, "t", 1)
    plan.binary = binary
    [first] = copy_pg_partitions(plan, [[0]])
    [again] = copy_pg_partitions(plan, [[0]])
    assert (first.rows, first.skipped, again.rows, again.skipped) == (2, False, 0, True)
    assert dst.cluster.execute("SELECT id, v FROM t ORDER BY id", dst.dbname) == [(1, "x"), (2, None)]
    assert dst.cluster.execute("SELECT part, rows FROM applier_sync_parts", dst.dbname) == [(0, 2)]


def test_a_tasks_consecutive_partitions_are_one_copy_and_one_transaction(spark, src: ScratchDb, dst: ScratchDb) -> None:
    """On local[2] one task copies all 4 partitions: one source COPY, one target transaction with all 4 records
    (no drain of the pipeline per partition); a rerun skips exactly the recorded partitions."""
    src.cluster.execute(SOURCE, src.dbname)
    dst.cluster.execute("CREATE TABLE b (id integer, n integer NOT NULL)", dst.dbname)
    migrate(dst.url)
    plan = _plan(src, dst.dsn, "b", 4)
    assert plan.partitions == 4
    done = copy_partitions(spark, plan, set(), "public.b")
    assert sorted((d.part, d.skipped) for d in done) == [(p, False) for p in range(4)]
    assert sum(d.rows for d in done) == 20000
    [(xid,)] = dst.cluster.execute("SELECT DISTINCT xmin::text FROM b", dst.dbname)
    assert dst.cluster.execute("SELECT part, xmin::text FROM applier_sync_parts ORDER BY part", dst.dbname) \
        == [(p, xid) for p in range(4)]
    assert [d.skipped for d in copy_partitions(spark, plan, set(), "public.b")] == [True] * 4
    assert dst.cluster.execute("SELECT count(*), count(DISTINCT id) FROM b", dst.dbname) == [(20000, 20000)]


@pytest.mark.parametrize("joining", [False, True])
def test_a_partition_of_a_replaced_run_does_not_land(src: ScratchDb, dst: ScratchDb, joining: bool) -> None:
    """A task of a killed run still copying (a cluster's executor) when a new run starts: its partition's
    transaction checks the run before it commits and rolls back; nothing of it lands."""
    src.cluster.execute(SOURCE, src.dbname)
    dst.cluster.execute("CREATE TABLE b (id integer, n integer NOT NULL)", dst.dbname)
    migrate(dst.url)
    plan = _plan(src, dst.dsn, "b", 1)
    if joining:  # sync --table: the run of the table's applier_sync_tables row
        plan.joining = ("public", "b")
        dst.cluster.execute("INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run) "
                            "VALUES ('n', 'public', 'b', 'copying', 'r')", dst.dbname)
    failed: list[BaseException] = []

    def old_task() -> None:
        try:
            copy_pg_partitions(plan, [[0]])
        except BaseException as exc:  # noqa: BLE001 - looked at below
            failed.append(exc)

    with psycopg.connect(dst.dsn) as new_run:
        new_run.execute("LOCK TABLE b IN SHARE MODE")  # the old task's COPY waits, its transaction begun
        task = threading.Thread(target=old_task)
        task.start()
        deadline = time.monotonic() + 30
        while not dst.cluster.execute("SELECT 1 FROM pg_locks WHERE relation = 'b'::regclass AND NOT granted",
                                      dst.dbname):
            assert time.monotonic() < deadline and task.is_alive(), failed
            time.sleep(0.05)
        if joining:  # as `sync --table` does for a table whose copy starts again
            new_run.execute("DELETE FROM applier_sync_tables WHERE name = 'n'")
            new_run.execute("INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run) "
                            "VALUES ('n', 'public', 'b', 'init', 'new')")
        else:  # as `sync` does when it starts a run
            new_run.execute("UPDATE applier_sync SET run = 'new' WHERE name = 'n'")
        new_run.commit()
    task.join(60)
    assert [str(e) for e in failed] == ["sync run r of 'n' is no longer the copy of public.b under way (a newer run "
                                        "replaced it, or it ended): its partitions are not written"]
    assert dst.cluster.execute("SELECT (SELECT count(*) FROM b), (SELECT count(*) FROM applier_sync_parts)",
                               dst.dbname) == [(0, 0)]


def test_a_sqlite_partition_of_an_ended_run_does_not_land(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    path = tmp_path / "replica.db"
    migrate(f"sqlite:///{path}")
    target_exec(f"sqlite:///{path}", "CREATE TABLE b (id INTEGER, n INTEGER NOT NULL)")
    plan = _plan(src, str(path), "b", 2)
    target_exec(f"sqlite:///{path}", "UPDATE applier_sync SET state = 'done'")
    with pytest.raises(CopyError, match=r"^copying public\.b failed: CopyError: sync run r of 'n' is no longer the "
                                        r"copy of public\.b under way"):
        copy_partitions(None, plan, set(), "public.b")
    assert target_exec(f"sqlite:///{path}", "SELECT (SELECT count(*) FROM b), (SELECT count(*) FROM "
                                            "applier_sync_parts)") == [(0, 0)]

FAIL_ONCE = """
CREATE TABLE b (id integer, n integer NOT NULL);
CREATE SEQUENCE fail_once;
CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.id > 15000 AND nextval('fail_once') = 1 THEN RAISE EXCEPTION 'injected failure at id %', NEW.id; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_once BEFORE INSERT ON b FOR EACH ROW EXECUTE FUNCTION fail_once();
ALTER TABLE b ENABLE ALWAYS TRIGGER fail_once;
"""


def test_a_failed_partition_is_retried_and_only_the_missing_partitions_are_written(
        spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    # target b without a key (a partition written twice would show as duplicates); its first row with id > 15000
    # fails, once (a sequence is not rolled back): the last of the 4 partitions fails after others are written;
    # each partition its own group (resume granularity: these tables' partitions would be one group)
    monkeypatch.setattr(spark_copy, "GROUP_PAGES", 1)
    dst.cluster.execute(FAIL_ONCE, dst.dbname)
    said: list[str] = []
    res = sync(make_config(src, dst.url, tmp_path / "work", partitions=4), spark=spark, say=said.append)
    [retry] = [s for s in said if "retrying the table once" in s]
    assert retry.startswith("copying public.b failed: RaiseException: injected failure at id 15"), said
    done = int(retry.split("resuming: ")[1].split(" of 4 ")[0])
    assert 1 <= done <= 3, retry
    assert {t.table: (t.rows, t.partitions) for t in res.tables} == {"public.a": (20000, 4), "public.b": (20000, 4)}
    # every row once; each partition in one transaction: 4 writing transactions in all
    assert dst.cluster.execute("SELECT count(*), count(DISTINCT id), count(DISTINCT xmin::text) FROM b",
                               dst.dbname) == [(20000, 20000, 4)]
    assert dst.cluster.execute("SELECT last_value FROM fail_once", dst.dbname)[0][0] > 1  # it did fail once


def test_a_sqlite_copy_resumes_with_the_missing_partitions(src: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    path = tmp_path / "replica.db"
    migrate(f"sqlite:///{path}")
    target_exec(f"sqlite:///{path}", "CREATE TABLE b (id INTEGER, n INTEGER NOT NULL)")
    target_exec(f"sqlite:///{path}", "CREATE TABLE armed (x)")
    target_exec(f"sqlite:///{path}", "INSERT INTO armed VALUES (1)")
    target_exec(f"sqlite:///{path}", "CREATE TRIGGER fail BEFORE INSERT ON b WHEN NEW.id > 15000 AND "
                                     "EXISTS (SELECT 1 FROM armed) BEGIN SELECT RAISE(ABORT, 'injected failure'); END")
    plan = _plan(src, str(path), "b", 4)
    assert plan.partitions == 4

    with pytest.raises(CopyError, match=r"^copying public\.b failed: IntegrityError: injected failure$"):
        copy_partitions(None, plan, set(), "public.b")
    parts = target_exec(f"sqlite:///{path}", "SELECT part, rows FROM applier_sync_parts ORDER BY part")
    assert [p for p, _ in parts] == [0, 1, 2]  # written in order, each with its rows; the failing one not
    assert target_exec(f"sqlite:///{path}", "SELECT count(*) FROM b")[0][0] == sum(r for _, r in parts)

    target_exec(f"sqlite:///{path}", "DELETE FROM armed")
    again = copy_partitions(None, plan, {p for p, _ in parts}, "public.b")
    assert [(d.part, d.skipped) for d in again] == [(3, False)]
    assert target_exec(f"sqlite:///{path}", "SELECT count(*), count(DISTINCT id) FROM b")[0] == (20000, 20000)


def test_a_sqlite_copy_holds_the_write_lock_only_while_it_writes(src: ScratchDb, tmp_path: Path) -> None:
    """An applier writing the same SQLite file (``sync --table`` beside ``applier run``) is not kept waiting
    while the copy reads the source: here the source table is locked, so the reads wait."""
    src.cluster.execute(SOURCE, src.dbname)
    path = tmp_path / "replica.db"
    migrate(f"sqlite:///{path}")
    target_exec(f"sqlite:///{path}", "CREATE TABLE b (id INTEGER, n INTEGER NOT NULL)")
    plan = _plan(src, str(path), "b", 2)
    done: list[object] = []
    with psycopg.connect(src.dsn) as blocker:
        blocker.execute("LOCK TABLE b IN ACCESS EXCLUSIVE MODE")
        copier = threading.Thread(target=lambda: done.append(copy_partitions(None, plan, set(), "public.b")))
        copier.start()
        time.sleep(1.5)  # the copy has started; its reads wait for the lock
        other = sqlite3.connect(path, timeout=0.5)
        try:
            other.execute("CREATE TABLE written_meanwhile (x)")  # "database is locked" if the copy held the lock
            other.commit()
        finally:
            other.close()
        blocker.rollback()
    copier.join(60)
    assert len(done) == 1 and target_exec(f"sqlite:///{path}", "SELECT count(*), count(DISTINCT id) FROM b") \
        == [(20000, 20000)]


def test_a_sqlite_targets_partitions_are_small(src: ScratchDb, tmp_path: Path) -> None:
    """A partition is written in one transaction that holds SQLite's write lock: a SQLite target's partitions are
    at most SQLITE_PART_PAGES, however few spark.partitions asks for."""
    src.cluster.execute("CREATE TABLE big (id int PRIMARY KEY, v text); "
                        "INSERT INTO big SELECT g, repeat('x', 200) || g FROM generate_series(1, 45000) g; "
                        "CREATE PUBLICATION pub FOR TABLE big", src.dbname)
    pages = src.cluster.execute("SELECT pg_relation_size('big') / 8192", src.dbname)[0][0]
    assert pages > SQLITE_PART_PAGES
    res = sync(make_config(src, f"sqlite:///{tmp_path / 'replica.db'}", tmp_path / "work", partitions=1))
    [table] = res.tables
    assert (table.rows, table.partitions) == (45000, -(-pages // SQLITE_PART_PAGES))


def test_a_slot_made_by_init_is_recreated_with_a_snapshot(spark, src: ScratchDb, dst: ScratchDb,
                                                          tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    init(cfg)
    said: list[str] = []
    res = sync(cfg, spark=spark, say=said.append)
    assert res.mode == "fresh"
    assert any("slot 'applier' exists but no copy has completed with it: dropping it" in s for s in said), said
    assert LSN.parse(_slot(src, "applier")[0]) == res.consistent_point == read_progress(cfg).lsn
    (system,), = src.cluster.execute("SELECT system_identifier::text FROM pg_control_system()", src.dbname)
    assert read_progress(cfg).source_system == system  # run/catchup will check they stream from this cluster


def test_a_completed_sync_is_repeated_only_when_forced(spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    first = sync(cfg, spark=spark)
    # a table published since: the refused sync creates nothing (a table made keyless for a copy that never comes
    # would be taken by a running daemon for one made by hand)
    src.cluster.execute("CREATE TABLE late (id int PRIMARY KEY); ALTER PUBLICATION pub ADD TABLE late", src.dbname)
    with pytest.raises(SyncError, match="already completed at .*Use --force"):
        sync(cfg, spark=spark)
    assert dst.cluster.execute("SELECT to_regclass('late')", dst.dbname) == [(None,)]
    said: list[str] = []
    again = sync(cfg, spark=spark, force=True, say=said.append)
    assert again.mode == "force" and again.consistent_point > first.consistent_point
    assert any("copying everything again" in s for s in said)
    assert dst.cluster.execute("SELECT count(*) FROM a", dst.dbname)[0][0] == 20000


def test_a_fresh_sync_refuses_tables_with_rows(spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    dst.cluster.execute("CREATE TABLE a (id int PRIMARY KEY, v text); INSERT INTO a VALUES (1, 'old')", dst.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    with pytest.raises(SyncError, match=r"target tables already hold rows: public\.a; .*--force"):
        sync(cfg, spark=spark)
    assert _slot(src, "applier") is None


def test_mismatched_target_tables_are_reported_by_table_and_column(src: ScratchDb, target_url: str,
                                                                   tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    if target_url.startswith("sqlite"):
        target_exec(target_url, "CREATE TABLE a (id INTEGER PRIMARY KEY, v INTEGER)")
        target_exec(target_url, "CREATE TABLE b (id INTEGER PRIMARY KEY, extra TEXT NOT NULL)")
        wrong = "column v: declared INTEGER (INTEGER affinity) would change the mapped TEXT values of source type text"
    else:
        target_exec(target_url, "CREATE TABLE a (id integer PRIMARY KEY, v integer)")
        target_exec(target_url, "CREATE TABLE b (id integer PRIMARY KEY, extra text NOT NULL)")
        wrong = "column v: source type text, target type integer"
    cfg = make_config(src, target_url, tmp_path / "work")
    with pytest.raises(SchemaError) as err:
        sync(cfg, spark=None)
    msg = str(err.value)
    assert f"target table {'a' if target_url.startswith('sqlite') else 'public.a'} (source public.a), {wrong}" in msg
    assert "(source public.b), column n: missing on the target" in msg
    assert "(source public.b), column extra: NOT NULL on the target without a default" in msg
    assert _slot(src, "applier") is None


def test_a_failed_syncs_slot_is_dropped_once_it_is_no_longer_active(src: ScratchDb, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src.cluster.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE a", src.dbname)
    cfg = make_config(src, f"sqlite:///{tmp_path / 'replica.db'}", tmp_path / "work")

    def streaming() -> WalSender:
        """A replication connection streaming from the slot: the slot is active until its walsender exits."""
        ws = WalSender(src.dsn)
        ws.start("applier", LSN(0), StreamOptions(publications=("pub",)))
        assert _slot(src, "applier")[1] is True
        return ws

    WalSender(src.dsn).create_slot("applier")
    holder = streaming()
    try:
        # still active when the drop starts (as right after sync closes its connection): dropped once it is not
        said: list[str] = []
        threading.Timer(1.0, holder.close).start()
        started = time.monotonic()
        _drop_incomplete_slot(cfg, said.append)
        assert time.monotonic() - started >= 1.0
        assert said == ["slot 'applier' dropped: the copy did not complete; `applier sync` creates it again"]
        assert _slot(src, "applier") is None

        # active for longer than the drop waits: kept, and said how to drop it
        WalSender(src.dsn).create_slot("applier")
        holder = streaming()
        monkeypatch.setattr("applier.migrate.sync.DROP_WAIT", 0.5)
        said.clear()
        _drop_incomplete_slot(cfg, said.append)
        assert len(said) == 1 and said[0].startswith("slot 'applier' is kept (replication slot \"applier\" is "
                                                     "active for PID "), said
        assert said[0].endswith("it holds WAL on the source until dropped: SELECT pg_drop_replication_slot('applier')")
        assert _slot(src, "applier") is not None
    finally:
        holder.close()
        src.cluster.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                            "WHERE database = current_database()", src.dbname)


def test_a_sync_stopped_while_it_builds_the_keys_is_rerun_and_ends_with_them(spark, src: ScratchDb, dst: ScratchDb,
                                                                            tmp_path: Path) -> None:
    """`applier sync` stopped by Ctrl-C (SIGINT to its process group) once a's rows are copied, while a's primary
    key is built and waits for a lock (a reader of a holds it) and b's copy, a Spark job, waits for another: the
    command ends at once, saying it was interrupted (the build is cancelled, not waited for: it waited on the reader
    forever before; the interrupt reaching the Spark job is not taken for a failed copy and retried, as it was when
    PySpark's clean-up replaced it with py4j's broken connection), the sync is not complete and a is left marked as
    owing its keys; the next sync restarts, copies a again and builds them, ending equal to the source. b, made by the user beforehand (as `pg_dump --schema-only` makes it),
    keeps its own index and gets nothing built. (a is small: the driver copies it; b is more than that, on a master of two copy streams: a Spark job.)"""
    src.cluster.execute(SOURCE + "INSERT INTO b SELECT g, g FROM generate_series(20001, 300000) g;", src.dbname)
    dst.cluster.execute("CREATE TABLE b (id integer PRIMARY KEY, n integer NOT NULL); CREATE INDEX b_by_n ON b (n)",
                        dst.dbname)
    # local[4]: two copy streams, so b is a Spark job (a master of one stream has the driver copy every table)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work", spark={"master": "local[4]"})
    keyed = "SELECT table_name FROM applier_keys_owed WHERE table_oid = 'a'::regclass::oid"
    said_file = tmp_path / "sync.err"
    with said_file.open("w") as said_to:
        command = popen(["sync", "-c", str(cfg_file), "-q"], stdout=subprocess.DEVNULL, stderr=said_to,
                        start_new_session=True)
    try:
        with psycopg.connect(dst.dsn, autocommit=True) as reader:
            wait_for("target table a created", lambda: command.poll() is not None or reader.execute(
                "SELECT to_regclass('a')").fetchone() != (None,))
            reader.execute("BEGIN")
            reader.execute("SELECT FROM a LIMIT 0")  # its lock lets the copy write, not the keys be built
            reader.execute("LOCK TABLE b IN SHARE MODE")  # and b's copy (a Spark job) wait
            wait_for("a's keys to be built", lambda: command.poll() is not None or bool(target_exec(
                dst.url, "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'ALTER TABLE % ADD PRIMARY KEY%' "
                         "AND wait_event_type = 'Lock'")))
            wait_for("b's copy to wait", lambda: command.poll() is not None or bool(target_exec(
                dst.url, "SELECT 1 FROM pg_locks WHERE relation = 'b'::regclass AND NOT granted")))
            assert command.poll() is None, "the sync ended without building a's keys after its copy"
            # read on the reader's own lock: another session's would queue behind the key build
            assert reader.execute("SELECT count(*) FROM a").fetchall() == [(20000,)]
            os.killpg(command.pid, signal.SIGINT)  # Ctrl-C: the command and its Spark JVM
            try:
                command.wait(60)  # the reader still holds its lock
            except subprocess.TimeoutExpired:
                raise AssertionError("the interrupted sync did not end; it said:\n" + said_file.read_text()) from None
            printed = said_file.read_text()  # not a failed copy retried: the interrupt ends the command
            assert command.returncode == 130 and "applier: interrupted" in printed.splitlines(), printed
            assert "Traceback" not in printed and "failed" not in printed, printed
            reader.execute("ROLLBACK")
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait(30)
    assert dst.cluster.execute("SELECT state FROM applier_sync", dst.dbname) == [("copying",)]
    assert dst.cluster.execute(INDEXES, dst.dbname, ["a"]) == []
    assert dst.cluster.execute(keyed, dst.dbname) == [("public.a",)]
    wait_for("the killed sync's walsender to exit", lambda: not (_slot(src, "applier") or ("", False))[1])

    said: list[str] = []
    cfg = load_config(cfg_file, env={})
    res = sync(cfg, spark=spark, say=said.append)
    assert res.mode == "restart"
    assert "public.a: keys built after the copy" in " ".join(said) and "public.b: keys" not in " ".join(said), said
    assert dst.cluster.execute(INDEXES, dst.dbname, ["a"]) == src.cluster.execute(INDEXES, src.dbname, ["a"])
    assert dst.cluster.execute(keyed, dst.dbname) == []
    assert [r[0] for r in dst.cluster.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'b' ORDER BY 1",
                                              dst.dbname)] == ["b_by_n", "b_pkey"]
    assert dst.cluster.execute("SELECT count(*), count(DISTINCT id) FROM a", dst.dbname) == [(20000, 20000)]
    assert verify(cfg, spark=spark).ok


def test_a_replica_identity_index_on_columns_not_published_is_not_built(spark, src: ScratchDb, dst: ScratchDb,
                                                                        tmp_path: Path) -> None:
    """An insert-only publication may leave the columns of the table's replica identity index out of its column
    list: the target gets the primary key (published) and no such index, as it gets no primary key whose columns
    are not published; the sync ends (the build failed after the copy, at every rerun, before)."""
    src.cluster.execute("CREATE TABLE r (id int PRIMARY KEY, k int NOT NULL, v text); CREATE UNIQUE INDEX r_k ON r (k);"
                        "ALTER TABLE r REPLICA IDENTITY USING INDEX r_k;"
                        "INSERT INTO r SELECT g, g, 'v' || g FROM generate_series(1, 1000) g;"
                        "CREATE PUBLICATION pub FOR TABLE r (id, v) WITH (publish = 'insert')", src.dbname)
    res = sync(make_config(src, dst.url, tmp_path / "work"), spark=spark)
    assert res.rows == 1000
    assert [r[0] for r in dst.cluster.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'r'",
                                              dst.dbname)] == ["r_pkey"]
    assert dst.cluster.execute("SELECT * FROM applier_keys_owed", dst.dbname) == []


def test_the_keys_of_many_tables_are_built_on_a_connection_a_worker(src: ScratchDb, dst: ScratchDb,
                                                                     tmp_path: Path) -> None:
    """A sync of many small tables, each creating its primary key after its copy (the command copies them itself):
    the key builds reuse their worker's target connection, so the target sees a session a table for its copy and a
    few for the command, not two a table, as an operator counts them in ``pg_stat_database``."""
    n = 12
    src.cluster.execute("; ".join(f"CREATE TABLE k{i} (id int PRIMARY KEY, v text); "
                                  f"INSERT INTO k{i} SELECT g, 'v' FROM generate_series(1, 20) g" for i in range(n))
                        + "; CREATE PUBLICATION pub FOR ALL TABLES", src.dbname)
    before = dst.sessions()
    assert sync(make_config(src, dst.url, tmp_path / "work")).rows == n * 20
    opened = dst.sessions() - before
    assert dst.cluster.execute("SELECT count(*) FROM pg_constraint WHERE contype = 'p' "
                               "AND conrelid::regclass::text LIKE 'k%'", dst.dbname) == [(n,)]
    assert dst.cluster.execute("SELECT count(*) FROM applier_keys_owed", dst.dbname) == [(0,)]
    assert opened <= n + 6, opened
