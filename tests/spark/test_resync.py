"""``applier resync``: a replica whose slot was dropped under it comes back by repair, not by a re-copy.

What a user relies on: the slot dropped while ``applier run`` follows a writer (the daemon stops, exit 6), the
writer going on (the gap); ``resync`` makes the slot again and repairs the tables at its snapshot; ``run`` started
again follows the new slot; the target ends equal to the source, each of the gap's transactions once (the writer's
updates add 1: one applied twice, or lost, leaves a value that differs; an insert applied twice stops the daemon,
``on_error = stop``), and the progress row names the lost slot.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.admin import status
from applier.migrate.resync import resync
from applier.migrate.sync import sync
from applier.sandbox.clusters import Cluster
from tests.plugins.clusters import ScratchDb, scratch_db
from tests.spark.conftest import make_config, target_exec
from tests.spark.test_add_table import cli, config_file, start_daemon
from tests.spark.test_repair import SOURCE, Writer, equal_soon, equal_then_stopped, recorded

pytest.importorskip("pyspark")


def drop_slot(src: ScratchDb) -> None:
    """The slot dropped by someone while the daemon streams from it (its walsender ended first)."""
    deadline = time.monotonic() + 30
    with psycopg.connect(src.dsn, autocommit=True) as conn:
        while True:
            conn.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                         "WHERE slot_name = 'applier' AND active_pid IS NOT NULL")
            try:
                conn.execute("SELECT pg_drop_replication_slot('applier')")
                return
            except psycopg.errors.ObjectInUse:
                assert time.monotonic() < deadline, "the slot stayed in use"
                time.sleep(0.02)


def test_slot_dropped_under_a_running_replica(src: ScratchDb, dst: ScratchDb, spark: Any, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    sync(cfg, spark=spark)
    log = tmp_path / "daemon.log"
    daemon = start_daemon(cfg_file, log)
    writer = Writer(src.dsn)
    writer.start()
    try:
        writer.pause(2.0)
        drop_slot(src)
        assert daemon.wait(60) == 6, log.read_text()  # the clear stop: the slot is gone
        writer.pause(1.0)  # the gap: committed while no slot keeps the changes for the replica
        said: list[str] = []
        began = target_exec(dst.url, "SELECT now()")[0][0]
        report = resync(cfg, spark=spark, say=said.append)
        daemon = start_daemon(cfg_file, log)
        writer.pause(1.0)  # and after the new slot's start
    finally:
        writer.stop()
    equal_then_stopped(src, dst.url, daemon, log)
    got = recorded(dst.url)
    assert got["t1"][1] > 0 and got["t1"][3] == 0, got  # the gap's rows inserted, nothing extra on the target
    assert any(t.ranges for t in report.tables)
    (slot, lsn, resynced_from, resynced_at) = target_exec(
        dst.url, "SELECT slot, lsn, resynced_from, resynced_at FROM applier_progress")[0]
    assert slot == "applier" and resynced_at is not None
    # the rewritten rows count as the copy's (not foreign to conflict detection): the copy ends after the resync's
    # rewrite, by the target's clock
    assert target_exec(dst.url, "SELECT finished_at::timestamptz FROM applier_sync")[0][0] >= began
    assert resynced_from.startswith("slot 'applier' does not exist on the source (dropped), applied up to "), \
        resynced_from
    assert any("made again at" in line for line in said), said
    # `applier status` says where the replica came from and when
    assert status(cfg)["resynced"] == {"from": resynced_from, "at": resynced_at}
    shown = cli("status", "-c", str(cfg_file))
    assert f"resynced: from {resynced_from}, at {resynced_at}\n" in shown.stdout, shown.stdout


def test_run_after_a_killed_resync_names_resync(src: ScratchDb, dst: ScratchDb, spark: Any, tmp_path: Path) -> None:
    """A resync killed after making the slot again (the progress row not moved, marked 'resync started'): the slot
    is ahead of the target, and `applier run` names the command that finishes the job, not a re-copy."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work")
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    sync(cfg, spark=spark)
    src.cluster.execute("INSERT INTO t1 VALUES (900001, 1, 'in the gap')", src.dbname)
    drop_slot(src)
    with psycopg.connect(src.dsn, autocommit=True) as conn:  # as the killed resync made it: after the gap
        conn.execute("SELECT pg_create_logical_replication_slot('applier', 'pgoutput')")
    target_exec(dst.url, "UPDATE applier_progress SET resynced_from = 'resync started: slot ''applier'' does not "
                         "exist on the source (dropped)', resynced_at = NULL")
    got = cli("catchup", "-c", str(cfg_file))
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert "did not end: run `applier resync` again" in got.stderr and "sync --force" not in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.parametrize("target_kind", ["postgresql", "sqlite"])
def test_resync_of_a_two_phase_replica(target_kind: str, src: ScratchDb, newest_target: Cluster, spark: Any,
                                       tmp_path: Path) -> None:
    """source.two_phase: transactions the target holds prepared from the lost slot (PREPARE TRANSACTION on a
    PostgreSQL target, holding row locks the rewrite needs; applier_prepared on SQLite) are rolled back and
    counted; one the source committed in the gap is in the new snapshot, one it rolled back nowhere."""
    with contextlib.ExitStack() as stack:
        target_url = (f"sqlite:///{tmp_path / 'replica.db'}" if target_kind == "sqlite"
                      else stack.enter_context(scratch_db(newest_target, "tgt")).url)
        if target_kind == "postgresql":  # a rewrite waiting for a prepared transaction's lock fails, not hangs
            target_exec(target_url, f"ALTER DATABASE {target_url.rsplit('/', 1)[1]} SET lock_timeout = '5s'")
            stack.callback(_roll_back_prepared, newest_target, target_url.rsplit("/", 1)[1])
        stack.callback(_roll_back_prepared, src.cluster, src.dbname)
        src.cluster.execute(SOURCE, src.dbname)
        cfg = make_config(src, target_url, tmp_path / "work", **{"source.two_phase": True})
        cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work",
                               source={"two_phase": True})
        sync(cfg, spark=spark)
        with psycopg.connect(src.dsn, autocommit=True) as conn:
            for gid, change in (("p1", "UPDATE t1 SET v = 5 WHERE id = 1"), ("p2", "UPDATE t1 SET v = 6 WHERE id = 2")):
                conn.execute("BEGIN")
                conn.execute(change)
                conn.execute(f"PREPARE TRANSACTION '{gid}'")
        caught = cli("catchup", "-c", str(cfg_file))
        assert caught.returncode == 0, caught.stderr
        assert len(status(cfg)["prepared_waiting"]) == 2
        drop_slot(src)
        for gap in ("COMMIT PREPARED 'p1'", "ROLLBACK PREPARED 'p2'", "INSERT INTO t1 VALUES (900001, 1, 'in the gap')"):
            src.cluster.execute(gap, src.dbname)
        said: list[str] = []
        resync(cfg, spark=spark, say=said.append)
        assert any(line.startswith("2 transactions prepared on the target from the lost slot rolled back")
                   for line in said), said
        assert status(cfg)["prepared_waiting"] == []
        src.cluster.execute("UPDATE t1 SET v = 7 WHERE id = 3", src.dbname)  # after the new slot's start
        caught = cli("catchup", "-c", str(cfg_file))
        assert caught.returncode == 0, caught.stderr
        equal_soon(src, target_url, seconds=0)


def _roll_back_prepared(cluster: Cluster, dbname: str) -> None:
    """What a failed test leaves prepared in ``dbname`` rolled back (a prepared transaction keeps a database from
    being dropped)."""
    for (gid,) in cluster.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()", dbname):
        cluster.execute(f"ROLLBACK PREPARED '{gid}'", dbname)
