"""``applier repair``: a damaged replica made equal to the source by rewriting only the differing key ranges.

What a user relies on: a target damaged by hand (rows deleted, changed and added, in a keyed table and in one
without a key) while ``applier run`` follows a writer ends equal to the source after ``repair``, the writer's
changes applied exactly once (an insert applied twice collides on the primary key: ``on_error = stop`` stops the
daemon), and the repair's records name the damage, not the table; ``--dry-run`` reports and writes nothing;
refusals are one line; a repair killed half-way is finished by a second run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.admin import status
from applier.errors import InUseError
from applier.migrate import repair as repair_module
from applier.migrate.repair import RepairError, _snapshot, compare_table, repair, rewrite_ranges
from applier.migrate.spark.rangehash import bucket_of
from applier.migrate.sync import SyncError, TargetDb, read_tables_in_snapshot, sync
from applier.progress.store import VERSION_TABLE
from applier.sandbox.clusters import find_install
from applier.targets.claim import copy_claim_name
from applier.targets.postgres.claim import pg_claim
from applier.targets.postgres.target import libpq_dsn
from tests.plugins.cli import popen
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db
from tests.spark.conftest import make_config, target_exec
from tests.spark.test_add_table import cli, config_file, start_daemon, stop_once

pytest.importorskip("pyspark")

SOURCE = """
CREATE TABLE t1 (id int PRIMARY KEY, v int NOT NULL, note text);
INSERT INTO t1 SELECT g, 0, 'seed ' || g FROM generate_series(1, 3000) g;
CREATE TABLE t2 (id int PRIMARY KEY, v int NOT NULL);
INSERT INTO t2 SELECT g, 0 FROM generate_series(1, 2000) g;
CREATE TABLE k (a int, b text);
ALTER TABLE k REPLICA IDENTITY FULL;
INSERT INTO k SELECT g % 300, 'k' || g FROM generate_series(1, 600) g;
CREATE PUBLICATION pub FOR TABLE t1, t2, k;
"""
TABLES = {"t1": "SELECT id, v, note FROM t1 ORDER BY id", "t2": "SELECT id, v FROM t2 ORDER BY id",
          "k": "SELECT a, b FROM k ORDER BY a, b"}
DAMAGE = [  # by hand on the target: t1 5 rows deleted, 5 changed, 3 added; t2 one deleted; k one gone, one added
    "DELETE FROM t1 WHERE id BETWEEN 1 AND 5", "UPDATE t1 SET v = -1 WHERE id BETWEEN 10 AND 14",
    "INSERT INTO t1 VALUES (100001, 1, 'x'), (100002, 2, 'y'), (100003, 3, 'z')", "DELETE FROM t2 WHERE id = 7",
    "DELETE FROM k WHERE b = 'k5'", "INSERT INTO k VALUES (-1, 'bogus')"]


class Writer(threading.Thread):
    """Small source transactions until stopped, away from the damaged rows: t1 rows added and updated, t2 and k
    updated."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True, name="writer")
        self.dsn = dsn
        self.halt = threading.Event()
        self.committed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                n = 0
                while not self.halt.is_set():
                    n += 1
                    with conn.transaction():
                        conn.execute("INSERT INTO t1 VALUES (%s, 0, 'new')", [10000 + n])
                        conn.execute("UPDATE t1 SET v = v + 1 WHERE id = %s", [2000 + n % 1000])
                        conn.execute("UPDATE t2 SET v = v + 1 WHERE id = %s", [1000 + n % 1000])
                        conn.execute("UPDATE k SET b = b || '+' WHERE b = %s", [f"k{400 + n % 100}"])
                    self.committed += 1
                    time.sleep(0.05)  # ~20/s: what lands between the daemon's answer and the snapshot stays small
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def pause(self, seconds: float) -> None:
        start, deadline = self.committed, time.monotonic() + seconds
        while time.monotonic() < deadline or self.committed < start + 5:
            assert self.error is None, self.error
            time.sleep(0.05)

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error


def damage(target_url: str) -> None:
    for sql in DAMAGE:
        target_exec(target_url, sql)


def contents(url_or_db: str | ScratchDb) -> dict[str, list[Any]]:
    if isinstance(url_or_db, ScratchDb):
        return {t: url_or_db.cluster.execute(q, url_or_db.dbname) for t, q in TABLES.items()}
    return {t: target_exec(url_or_db, q) for t, q in TABLES.items()}


def equal_soon(src: ScratchDb, target_url: str, seconds: float = 90) -> None:
    want = contents(src)
    deadline = time.monotonic() + seconds
    while True:
        try:
            got = contents(target_url)
        except Exception:  # noqa: BLE001 - SQLite may be busy
            got = {}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for t in TABLES:
        assert got.get(t) == want[t], t


def equal_then_stopped(src: ScratchDb, target_url: str, daemon: subprocess.Popen[str], log: Path) -> str:
    """Wait until the target equals the source, then stop the daemon (SIGTERM): it must exit 0. Its log."""
    return stop_once(lambda: equal_soon(src, target_url), daemon, log)


def synced_and_following(src: ScratchDb, target_url: str, spark: Any, tmp_path: Path
                         ) -> tuple[Any, Path, Path, subprocess.Popen[str]]:
    """SOURCE synced to the target, `applier run` started on it: (config, its file, the daemon's log, the daemon)."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, target_url, tmp_path / "work")
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
    sync(cfg, spark=spark)
    log = tmp_path / "daemon.log"
    return cfg, cfg_file, log, start_daemon(cfg_file, log)


def recorded(target_url: str) -> dict[str, tuple[int, int, int, int]]:
    """Per table: (ranges, inserted, updated, deleted) recorded in applier_repairs."""
    rows = target_exec(target_url, "SELECT table_name, count(*), sum(rows_inserted), sum(rows_updated), "
                                   "sum(rows_deleted) FROM applier_repairs GROUP BY table_name")
    return {r[0]: tuple(int(x) for x in r[1:]) for r in rows}  # type: ignore[misc]


@pytest.mark.parametrize(("version", "target_kind"), [(18, "postgresql"), (15, "sqlite")],
                         ids=["pg18-postgresql", "pg15-sqlite"])
def test_repair_under_a_running_daemon(version: int, target_kind: str, pg_clusters: ClusterPool, newest_target: Any,
                                       spark: Any, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(scratch_db(pg_clusters.get(find_install(version), "source"), "src"))
        target_url = (f"sqlite:///{tmp_path / 'replica.db'}" if target_kind == "sqlite"
                      else stack.enter_context(scratch_db(newest_target, "tgt")).url)
        src.cluster.execute(SOURCE, src.dbname)
        cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
        sync(make_config(src, target_url, tmp_path / "work"), spark=spark)
        log = tmp_path / "daemon.log"
        daemon = start_daemon(cfg_file, log)
        deadline = time.monotonic() + 60
        while "applier run: source" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)  # running (the repair asks it to hold the tables), not starting later
        writer = Writer(src.dsn)
        writer.start()
        try:
            writer.pause(1.0)
            damage(target_url)
            writer.pause(0.5)
            said: list[str] = []
            report = repair(make_config(src, target_url, tmp_path / "work"), spark=spark, say=said.append)
            writer.pause(1.0)
        finally:
            writer.stop()
        text = equal_then_stopped(src, target_url, daemon, log)
        assert "ERROR" not in text, text
        assert "`applier repair` asks for its changes to be held" in text
        got = recorded(target_url)
        # the damage, and the writer's changes held between the daemon's answer and the snapshot (a few seconds on a
        # loaded machine: ~40 rows of t1 a second): not the table (its ~3,000 rows fill ~970 of the 1024 ranges)
        ranges, inserted, updated, deleted = got["t1"]
        assert deleted == 3 and inserted >= 5 and updated >= 5 and ranges < 400, got
        assert got["t2"][0] >= 1 and got["t2"][1] >= 1 and got["t2"][3] == 0, got
        assert got["k"][0] < 100 and got["k"][1] >= 1 and got["k"][3] >= 1, got
        by = {t.table: t for t in report.tables}
        assert by["public.t1"].counts == (inserted, updated, deleted)
        assert not by["public.k"].keyed
        assert target_exec(target_url, "SELECT DISTINCT state FROM applier_sync_tables") == [("ready",)]


def test_dry_run_and_refusals(src: ScratchDb, dst: ScratchDb, spark: Any, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    sync(cfg, spark=spark)
    damage(dst.url)
    before = contents(dst.url)
    # a replica whose control tables are older than the repair's (no applier_repairs, no resynced_from), made by
    # `applier init` over tables copied by hand (no applier_sync row): a dry run reports, upgrading nothing
    downgrade(dst.url, "0008")
    target_exec(dst.url, "DELETE FROM applier_sync")
    report = repair(cfg, dry_run=True, spark=spark)
    assert contents(dst.url) == before
    assert target_exec(dst.url, f"SELECT version_num FROM {VERSION_TABLE}") == [("0008",)]  # not upgraded
    assert target_exec(dst.url, "SELECT count(*) FROM applier_sync_tables") == [(0,)]
    by = {t.table: t for t in report.tables}
    assert by["public.t1"].counts == (5, 5, 3) and not by["public.t1"].rewritten
    assert by["public.t2"].counts == (1, 0, 0)
    assert report.lines()[-1].startswith("repair --dry-run: 3 of 3 tables differ")

    with pytest.raises(SyncError, match="source table public.nope does not exist"):
        repair(cfg, ["public.nope"], spark=spark)
    with psycopg.connect(libpq_dsn(dst.url), autocommit=True) as other:
        pg_claim(other, copy_claim_name("applier", "public", "t1"), "sync --table")
        with pytest.raises(InUseError, match=r"source table public.t1 is being repaired or copied .* applier sync "
                                            r"--table \(pid"):
            repair(cfg, ["public.t1"], spark=spark)
    extra: dict[str, Any] = {"source.two_phase": True}
    two_phase = make_config(src, dst.url, tmp_path / "work", **extra)
    with pytest.raises(RepairError, match="two.phase.*cannot be placed before or after"):
        repair(two_phase, ["public.t1"], spark=spark)
    # a refusal found at the second table leaves the first one's row alone (no table held)
    target_exec(dst.url, "INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run) "
                         "VALUES ('applier', 'public', 't2', 'copying', 'other')")
    with pytest.raises(RepairError, match=r"source table public.t2 is being copied by `applier sync --table` "
                                          r"\(copying"):
        repair(cfg, ["public.t1", "public.t2"], spark=spark)
    assert target_exec(dst.url, "SELECT table_name, state FROM applier_sync_tables") == [("t2", "copying")]
    target_exec(dst.url, "DELETE FROM applier_sync_tables")
    assert contents(dst.url) == before
    # a table named twice (also as "t2" and "public.t2") is repaired once
    report = repair(cfg, ["t2", "public.t2", "t2"], spark=spark)
    assert [(t.table, t.counts) for t in report.tables] == [("public.t2", (1, 0, 0))]
    assert target_exec(dst.url, "SELECT table_name, state FROM applier_sync_tables") == [("t2", "ready")]
    # a Spark job that fails (here the row filter, evaluated by the workers' reads): one line naming the table
    src.cluster.execute("ALTER PUBLICATION pub SET TABLE t1, t2 WHERE (id / (id - id) = 0), k", src.dbname)
    with pytest.raises(RepairError, match=r"^comparing source table public.t2 with target table public.t2 failed: "
                                          r"\S+: division by zero$"):
        repair(cfg, ["public.t2"], dry_run=True, spark=spark)
    # a column the source has and the target table lacks (a schema change not applied yet): refused, nothing held
    src.cluster.execute("ALTER TABLE t1 ADD COLUMN x int", src.dbname)
    with pytest.raises(RepairError, match=r"^target table public.t1 lacks column\(s\) x of source table public.t1: a "
                                          r"schema change `applier run` has not applied yet"):
        repair(cfg, ["public.t1"], spark=spark)
    assert target_exec(dst.url, "SELECT table_name, state FROM applier_sync_tables") == [("t2", "ready")]


def downgrade(url: str, revision: str) -> None:
    """The target's control tables taken back to ``revision`` (as an older applier left them)."""
    from alembic import command
    from sqlalchemy import create_engine

    from applier.progress.migrate import _alembic_config

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            cfg = _alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)
    finally:
        engine.dispose()


def test_killed_halfway_then_rerun(src: ScratchDb, dst: ScratchDb, spark: Any, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    sync(make_config(src, dst.url, tmp_path / "work"), spark=spark)
    target_exec(dst.url, "UPDATE t1 SET v = -1 WHERE id % 3 = 0")  # most ranges differ
    alike = "SELECT id, xmin::text FROM t1 WHERE id % 3 <> 0 ORDER BY id"
    untouched = target_exec(dst.url, alike)  # the rows alike on both sides: left as they are
    # the damaged row of the last key range locked: the repair's last transaction waits for it, after its first
    lock = psycopg.connect(libpq_dsn(dst.url))
    lock.execute(f"SELECT id FROM t1 WHERE id % 3 = 0 ORDER BY {bucket_of(['id'])} DESC LIMIT 1 FOR UPDATE")
    watch = psycopg.connect(libpq_dsn(dst.url), autocommit=True)  # one connection for the looks, not one a look
    proc = popen(["repair", "-c", str(cfg_file), "--table", "public.t1"], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            if watch.execute("SELECT count(*) FROM applier_repairs").fetchone() >= (1,):
                running = status(make_config(src, dst.url, tmp_path / "work"))["repairs"]
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.close()
        lock.close()
    assert proc.returncode == -signal.SIGKILL, proc.communicate()
    assert target_exec(dst.url, "SELECT state FROM applier_sync_tables") == [("repairing",)]
    # `applier status` names the table under repair, its snapshot, since when and who; once killed, nobody
    (snapshot_lsn,) = target_exec(dst.url, "SELECT snapshot_lsn FROM applier_sync_tables")[0]
    assert [{**r, "since": bool(r["since"])} for r in running] == [
        {"table": "public.t1", "state": "repairing", "snapshot_lsn": snapshot_lsn, "since": True,
         "by": running[0]["by"]}]
    assert "repair (pid" in running[0]["by"], running
    shown = cli("status", "-c", str(cfg_file))
    assert f"repair: public.t1 repairing, at snapshot {snapshot_lsn}, since " in shown.stdout, shown.stdout
    assert "by nobody: not running (killed or failed)" in shown.stdout, shown.stdout
    done = target_exec(dst.url, "SELECT count(*) FROM applier_repairs")[0][0]
    assert 1 <= done < 1000
    # the source goes on meanwhile: those changes are in the rerun's snapshot, or applied after it, once each
    src.cluster.execute("INSERT INTO t1 VALUES (5001, 5, 'after the kill'); UPDATE t1 SET v = 9 WHERE id = 3",
                        src.dbname)
    report = repair(make_config(src, dst.url, tmp_path / "work"), ["public.t1"], spark=spark)
    src.cluster.execute("INSERT INTO t1 VALUES (5002, 5, 'after the rerun'); UPDATE t1 SET v = 10 WHERE id = 6",
                        src.dbname)
    assert report.tables[0].ranges and len(report.tables[0].ranges) < 1024
    assert target_exec(dst.url, alike) == untouched
    caught = cli("catchup", "-c", str(cfg_file))
    assert caught.returncode == 0, caught.stderr
    equal_soon(src, dst.url, seconds=0)


def soon(check: Any, what: str, seconds: float = 60) -> None:
    """Wait until ``check()`` is true."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_daemon_holds_a_table_the_repair_answered_for(src: ScratchDb, dst: ScratchDb, spark: Any,
                                                      tmp_path: Path) -> None:
    """A repair that found no applier (its claim's connection lost) answered itself: the row is 'repairing' though
    the running daemon never saw 'repair'. The daemon holds the table's changes from then on, not applying them
    under the rewrite."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    sync(make_config(src, dst.url, tmp_path / "work"), spark=spark)
    log = tmp_path / "daemon.log"
    daemon = start_daemon(cfg_file, log)
    try:
        src.cluster.execute("UPDATE t2 SET v = 1 WHERE id = 1", src.dbname)  # the daemon binds t2
        soon(lambda: target_exec(dst.url, "SELECT v FROM t2 WHERE id = 1") == [(1,)], "t2 applied")
        target_exec(dst.url, "INSERT INTO applier_sync_tables (name, schema_name, table_name, state, run) "
                             "VALUES ('applier', 'public', 't2', 'repairing', 'a repair')")
        time.sleep(3)  # the daemon polls about once a second
        src.cluster.execute("UPDATE t2 SET v = 2 WHERE id = 1; UPDATE t1 SET v = 2 WHERE id = 1", src.dbname)
        soon(lambda: target_exec(dst.url, "SELECT v FROM t1 WHERE id = 1") == [(2,)], "t1 applied")
        soon(lambda: target_exec(dst.url, "SELECT count(*) FROM applier_held")[0][0] == 1, "t2's change held")
        assert target_exec(dst.url, "SELECT v FROM t2 WHERE id = 1") == [(1,)]
        assert "is being repaired (`applier repair`), which did not wait" in log.read_text()
        target_exec(dst.url, "UPDATE applier_sync_tables SET state = 'ready', snapshot_lsn = '0/0'")  # drained
        soon(lambda: target_exec(dst.url, "SELECT v FROM t2 WHERE id = 1") == [(2,)], "t2's held change applied")
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
    assert code == 0, log.read_text()


def test_unique_values_moved_between_rows_of_far_ranges(src: ScratchDb, target_url: str, spark: Any,
                                                        tmp_path: Path) -> None:
    """Every target row holds the next row's unique value: a rewrite of one group of ranges cannot copy its rows
    back while rows of later groups hold their values; the repair still ends with the source's rows, each range
    recorded once, and rows whose key the target holds twice (no primary key there) rewritten."""
    src.cluster.execute("CREATE TABLE u (id int PRIMARY KEY, code int NOT NULL UNIQUE, v int NOT NULL);"
                        "INSERT INTO u SELECT g, g, 0 FROM generate_series(1, 5000) g;"
                        "CREATE PUBLICATION pub FOR TABLE u", src.dbname)
    target_exec(target_url, "CREATE TABLE u (id int NOT NULL, code int NOT NULL UNIQUE, v int NOT NULL)")
    cfg = make_config(src, target_url, tmp_path / "work")
    sync(cfg, spark=spark)
    target_exec(target_url, "UPDATE u SET code = -code")
    target_exec(target_url, "UPDATE u SET code = -code % 5000 + 1")  # each row the next one's value
    target_exec(target_url, "INSERT INTO u VALUES (7, -7, 0), (8, -8, 0)")  # keys held twice
    report = repair(cfg, spark=spark)
    want = src.cluster.execute("SELECT id, code, v FROM u ORDER BY id", src.dbname)
    assert target_exec(target_url, "SELECT id, code, v FROM u ORDER BY id") == [tuple(r) for r in want]
    (found,) = report.tables
    assert len(found.ranges) > 64  # more than one transaction's worth
    assert found.counts == (0, 5000, 2)
    assert recorded(target_url)["u"] == (len(found.ranges), *found.counts)


def test_repair_answered_while_the_daemon_waits_for_a_table(src: ScratchDb, dst: ScratchDb, spark: Any,
                                                            tmp_path: Path) -> None:
    """The daemon waits for another table (published, no target table: apply.new_tables = "wait"): it answers the
    repair while it waits, and the repaired table's changes around the snapshot land once the wait is over."""
    cfg, cfg_file, log, daemon = synced_and_following(src, dst.url, spark, tmp_path)
    done: list[Any] = []
    repairing = threading.Thread(target=lambda: done.append(_repaired(cfg, spark)), daemon=True)
    try:
        src.cluster.execute("CREATE TABLE t3 (id int PRIMARY KEY); ALTER PUBLICATION pub ADD TABLE t3; "
                            "INSERT INTO t3 VALUES (1); UPDATE t1 SET v = 7 WHERE id = 100", src.dbname)
        soon(lambda: "waiting for `applier sync --table public.t3`" in log.read_text(), "the daemon waits for t3")
        for sql in DAMAGE[:3]:  # t1's damage
            target_exec(dst.url, sql)
        repairing.start()
        repairing.join(90)
        assert done, f"the repair still waits for the daemon, which waits for public.t3: {log.read_text()}"
        assert not isinstance(done[0], BaseException), done[0]
        assert done[0].tables[0].counts == (5, 6, 3)  # the damage, and the update the daemon had not applied
        src.cluster.execute("UPDATE t1 SET v = 8 WHERE id = 101", src.dbname)  # after the snapshot
        target_exec(dst.url, "CREATE TABLE t3 (id int PRIMARY KEY)")  # the wait ends
        want = src.cluster.execute(TABLES["t1"], src.dbname)
        soon(lambda: target_exec(dst.url, TABLES["t1"]) == want, "t1 equal to the source")
        soon(lambda: target_exec(dst.url, "SELECT id FROM t3") == [(1,)], "t3's row applied")
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        if repairing.ident is not None:  # started: it ends once nobody applies (it answers itself)
            repairing.join(120)
    assert code == 0, log.read_text()
    assert "held from now on (answered while waiting)" in log.read_text()


def _repaired(cfg: Any, spark: Any, tables: tuple[str, ...] | list[str] = ("public.t1",)) -> Any:
    """``repair`` of ``tables``, or what it raised."""
    try:
        return repair(cfg, list(tables), spark=spark)
    except BaseException as exc:  # noqa: BLE001 - asserted by the caller
        return exc


def test_a_schema_change_between_the_hold_and_the_snapshot(src: ScratchDb, dst: ScratchDb, spark: Any,
                                                           tmp_path: Path) -> None:
    """Columns added (t2), dropped and altered (t1) on tables under repair after their changes are held and before the
    snapshot: the repair of each stops with one line, rewriting nothing in it (a drop was silently skipped before,
    the target table left in its old shape), and releases it; the applier then applies the held changes (the
    column added: schema_changes = "add_columns"), and a rerun repairs them. The other table named (k) is
    repaired."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    sync(cfg, spark=spark)
    damage(dst.url)
    done: list[Any] = []
    with psycopg.connect(src.dsn) as running:  # a transaction with an xid: the repair's slot waits for its end
        running.execute("SELECT pg_current_xact_id()")
        repairing = threading.Thread(target=lambda: done.append(_repaired(cfg, spark, ["t1", "t2", "k"])),
                                     daemon=True)
        repairing.start()
        soon(lambda: target_exec(dst.url, "SELECT count(*) FROM applier_sync_tables WHERE state = 'repairing'")
             == [(3,)], "the tables held")
        src.cluster.execute("BEGIN; ALTER TABLE t2 ADD COLUMN w int; UPDATE t2 SET v = 3, w = 7 WHERE id = 1; "
                            "ALTER TABLE t1 DROP COLUMN note, ALTER COLUMN v DROP NOT NULL; UPDATE t1 SET v = 4 WHERE id = 1000; "
                            "COMMIT",
                            src.dbname)  # after the hold, before the snapshot
        running.commit()
    repairing.join(120)
    assert done and isinstance(done[0], RepairError), done
    line = str(done[0])
    assert "\n" not in line and line.startswith("source table public.t1 changed shape at the repair's snapshot "), line
    assert "(column(s) note dropped or renamed; column(s) v altered on the source) and target table public.t1 does " \
           "not have that shape " \
           "yet; nothing rewritten in it: `applier run` now applies its held changes" in line, line
    assert "(column(s) w added or renamed on the source) and target table public.t2" in line, line
    assert set(recorded(dst.url)) == {"k"}  # t1, t2: nothing rewritten
    assert target_exec(dst.url, "SELECT DISTINCT state FROM applier_sync_tables") == [("ready",)]
    caught = cli("catchup", "-c", str(cfg_file), env={"APPLIER_APPLY_SCHEMA_CHANGES": "add_columns"})
    assert caught.returncode == 0, caught.stderr
    assert target_exec(dst.url, "SELECT w, v FROM t2 WHERE id = 1") == [(7, 3)]  # the held change, column and all
    report = repair(cfg, ["public.t1", "public.t2"], spark=spark)
    assert [t.counts for t in report.tables] == [(5, 5, 3), (1, 0, 0)]  # the damage, in the new shapes
    for query in ("SELECT id, v FROM t1 ORDER BY id", "SELECT id, v, w FROM t2 ORDER BY id", TABLES["k"]):
        assert target_exec(dst.url, query) == src.cluster.execute(query, src.dbname)


def test_daemon_killed_during_a_repair(src: ScratchDb, dst: ScratchDb, spark: Any, tmp_path: Path) -> None:
    """The daemon SIGKILLed while the repair rewrites (it holds t1's changes, some written to applier_held, others
    in its open transaction): the repair finishes, the daemon started again drains and follows; the target equals
    the source, the writer's changes once each (an insert applied twice stops the daemon: on_error = stop)."""
    cfg, cfg_file, log, daemon = synced_and_following(src, dst.url, spark, tmp_path)
    soon(lambda: "applier run: source" in log.read_text(), "the daemon running")
    target_exec(dst.url, "UPDATE t1 SET v = -1 WHERE id % 3 = 0")  # most ranges differ: the rewrite takes a while
    writer = Writer(src.dsn)
    writer.start()
    done: list[Any] = []
    repairing = threading.Thread(target=lambda: done.append(_repaired(cfg, spark)), daemon=True)
    try:
        writer.pause(0.5)
        repairing.start()
        soon(lambda: target_exec(dst.url, "SELECT count(*) FROM applier_repairs")[0][0] >= 3, "the rewrite going on",
             seconds=120)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(30)
        repairing.join(300)
        assert done and not isinstance(done[0], BaseException), done
        daemon = start_daemon(cfg_file, log)
        writer.pause(1.0)
    finally:
        writer.stop()
    equal_then_stopped(src, dst.url, daemon, log)
    assert target_exec(dst.url, "SELECT count(*) FROM applier_held") == [(0,)]


def test_a_source_table_rewritten_between_the_comparison_and_the_rewrite(src: ScratchDb, dst: ScratchDb, spark: Any,
                                                                         tmp_path: Path) -> None:
    """The comparison finds the rows to copy by their place (ctid) in the snapshot; a VACUUM FULL of the source
    table before the rewrite moves them: the rewrite stops with one line instead of copying other rows."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    sync(cfg, spark=spark)
    src.cluster.execute("DELETE FROM t1 WHERE id <= 1000", src.dbname)  # VACUUM FULL compacts: later rows move
    target_exec(dst.url, "DELETE FROM t1 WHERE id <= 1000")
    target_exec(dst.url, "UPDATE t1 SET v = -1 WHERE id BETWEEN 2001 AND 2005")
    target_exec(dst.url, "DELETE FROM t1 WHERE id BETWEEN 2006 AND 2010")
    target = TargetDb(cfg)
    try:
        with _snapshot(cfg, "test") as (snapshot, at):
            t1 = next(t for t in read_tables_in_snapshot(cfg, snapshot) if t.name == "t1")
            found = compare_table(cfg, target, spark, t1, snapshot)
            assert found.counts == (5, 5, 0)
            src.cluster.execute("VACUUM FULL t1", src.dbname)
            before = contents(dst.url)
            with pytest.raises(RepairError, match="source table public.t1 was rewritten .* while it was compared"):
                rewrite_ranges(cfg, target, t1, found, snapshot, str(at), "test", lambda line: None)
            assert contents(dst.url) == before
    finally:
        target.close()


def test_large_ranges_are_split_so_that_few_alike_rows_are_read(src: ScratchDb, target_url: str, spark: Any,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A key range holding many rows (a large table: here a small one, with the limits lowered) is split into
    parts by the next bits of the key's hash before rows are read: the repair still rewrites exactly the rows
    that differ."""
    monkeypatch.setattr(repair_module, "READ_ROWS", 1000)
    monkeypatch.setattr(repair_module, "PART_ROWS", 1)
    caplog.set_level(logging.DEBUG, logger="applier.repair")
    src.cluster.execute("CREATE TABLE big (id int PRIMARY KEY, v int NOT NULL);"
                        "INSERT INTO big SELECT g, 0 FROM generate_series(1, 50000) g;"
                        "CREATE PUBLICATION pub FOR TABLE big", src.dbname)
    cfg = make_config(src, target_url, tmp_path / "work")
    sync(cfg, spark=spark)
    target_exec(target_url, "UPDATE big SET v = -1 WHERE id % 500 = 0")  # 100 rows in about 95 ranges
    target_exec(target_url, "DELETE FROM big WHERE id % 500 = 1")
    # the rows alike on both sides keep their place (SQLite: rowid), untouched (PostgreSQL: xmin)
    alike = "SELECT id, " + ("rowid" if target_url.startswith("sqlite") else "xmin::text") + \
        " FROM big WHERE id % 500 > 1 ORDER BY id"
    untouched = target_exec(target_url, alike)
    report = repair(cfg, spark=spark)
    assert "public.big: " in caplog.text and "split into parts of 15 bits" in caplog.text
    assert report.tables[0].counts == (100, 100, 0)
    want = src.cluster.execute("SELECT id, v FROM big ORDER BY id", src.dbname)
    assert target_exec(target_url, "SELECT id, v FROM big ORDER BY id") == [tuple(r) for r in want]
    assert target_exec(target_url, alike) == untouched
