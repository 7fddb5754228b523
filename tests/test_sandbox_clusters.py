"""Real throwaway servers from applier.sandbox.clusters: configuration, privileges, slots, lifecycle.

No mocks: every test starts actual PostgreSQL processes for each available major version.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from applier.sandbox.clusters import Cluster, PgInstall, find_install, find_installs
from tests.conftest import SHM, memory_tmp
from tests.plugins.clusters import ScratchDb


def _uid(pid: int) -> int:
    """Real uid of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def _refuses(dsn: str) -> bool:
    """True if nothing accepts connections at ``dsn``."""
    try:
        psycopg.connect(dsn, connect_timeout=3).close()
    except psycopg.OperationalError:
        return True
    return False


def test_find_installs_sorted_and_complete() -> None:
    installs = find_installs()
    assert installs, "no PostgreSQL install found"
    assert [i.version for i in installs] == sorted({i.version for i in installs})
    for install in installs:
        for name in ("postgres", "initdb", "pg_ctl", "pg_recvlogical"):
            assert install.bin(name).is_file()
        assert (install.bindir.parent / "lib" / "pgoutput.so").is_file()
    assert find_install() == installs[-1]
    with pytest.raises(LookupError, match="PostgreSQL 7 not available"):
        find_install(7)


def test_cluster_lifecycle(pg_install: PgInstall) -> None:
    cluster = Cluster(pg_install, name="lifecycle")
    with cluster:
        assert cluster.execute("SHOW wal_level") == [("logical",)]
        assert cluster.execute("SHOW listen_addresses") == [("127.0.0.1",)]
        version_num = int(cluster.execute("SHOW server_version_num")[0][0])
        assert version_num // 10000 == pg_install.version

        with psycopg.connect(cluster.dsn()) as conn:
            backend = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert backend is not None
            assert _uid(backend[0]) != 0
        assert cluster.pid is not None and _uid(cluster.pid) != 0

        cluster.execute("SELECT pg_create_logical_replication_slot('t_slot', 'pgoutput')")
        assert cluster.execute("SELECT plugin FROM pg_replication_slots WHERE slot_name = 't_slot'") == [("pgoutput",)]
        cluster.execute("SELECT pg_drop_replication_slot('t_slot')")
        assert cluster.execute("SELECT count(*) FROM pg_replication_slots") == [(0,)]
        dsn, base_dir = cluster.dsn(), cluster.base_dir
    assert not cluster.running
    assert _refuses(dsn)
    assert not base_dir.exists(), "stop() must remove the temp dir it created"
    cluster.stop()  # idempotent


def test_statements_on_postgres_share_one_connection_and_each_starts_a_fresh_session(pg_install: PgInstall) -> None:
    """``execute`` on the maintenance database keeps its connection (no server process started per statement), yet
    each statement finds the session as a new connection would: no setting, lock, temporary table or open
    transaction of the one before; a session the server ended, a restart and a crash are each followed by a new
    connection."""
    with Cluster(pg_install, name="kept") as cluster:
        [(kept, name)] = cluster.execute("SELECT pg_backend_pid(), current_setting('application_name')")
        cluster.execute("SET application_name = 'left'; SELECT pg_advisory_lock(7); CREATE TEMP TABLE tt ()")
        assert cluster.execute("SELECT pg_backend_pid(), current_setting('application_name'), to_regclass('tt'), "
                               "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory')") == [(kept, name, None, 0)]
        for _ in range(8):  # more than psycopg's prepare threshold: what the reset drops was never prepared
            assert cluster.execute("SELECT pg_backend_pid()") == [(kept,)]
        cluster.execute("BEGIN; CREATE TABLE half ()")  # a transaction left open ends with its connection
        assert cluster.execute("SELECT to_regclass('half'), pg_backend_pid() <> %s", params=[kept]) == [(None, True)]

        [(kept,)] = cluster.execute("SELECT pg_backend_pid()")
        with psycopg.connect(cluster.dsn(), autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s, 5000)", [kept])
        assert cluster.execute("SELECT pg_backend_pid() <> %s", params=[kept]) == [(True,)]
        cluster.restart()
        assert cluster.execute("SELECT 1") == [(1,)]
        cluster.kill()
        cluster.start()
        assert cluster.execute("SELECT 1") == [(1,)]


def test_each_database_keeps_its_connection_yet_sees_new_defaults_and_can_be_a_template(pg_install: PgInstall) -> None:
    """``execute`` keeps a connection per database; what ``ALTER DATABASE/ROLE … SET`` gives new sessions reaches
    the next statement; a database it keeps a connection to can still be copied (``CREATE DATABASE … TEMPLATE``),
    renamed and dropped without ``FORCE``, at once; ``release`` leaves the database without a session of ours."""
    with Cluster(pg_install, name="keptdbs") as cluster:
        cluster.create_database("a")
        [(kept,)] = cluster.execute("SELECT pg_backend_pid()", "a")
        assert cluster.execute("SELECT pg_backend_pid()", "a") == [(kept,)]
        assert cluster.execute("SELECT pg_backend_pid() <> %s", params=[kept]) == [(True,)]  # postgres: its own

        cluster.execute("ALTER DATABASE a SET work_mem = '7MB'")
        assert cluster.execute("SELECT current_setting('work_mem')", "a") == [("7MB",)]
        cluster.execute("ALTER ROLE postgres IN DATABASE a SET work_mem = '9MB'", "a")
        assert cluster.execute("SELECT current_setting('work_mem')", "a") == [("9MB",)]
        cluster.execute("ALTER ROLE postgres IN DATABASE a RESET work_mem")

        cluster.execute("CREATE TABLE t AS SELECT 1 AS x", "a")
        cluster.execute("CREATE DATABASE b TEMPLATE a")
        assert cluster.execute("SELECT x FROM t", "b") == [(1,)]
        cluster.execute("ALTER DATABASE b RENAME TO c")
        assert cluster.execute("SELECT x FROM t", "c") == [(1,)]
        cluster.execute("DROP DATABASE c")

        cluster.execute("SELECT 1", "a")
        cluster.release("a")
        # the backend ends after the client closed (PostgreSQL's DROP DATABASE waits up to 5 s for that too)
        deadline = time.monotonic() + 5
        while cluster.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = 'a'") != [(0,)]:
            assert time.monotonic() < deadline, cluster.execute("SELECT * FROM pg_stat_activity WHERE datname = 'a'")
            time.sleep(0.05)
        cluster.drop_database("a")
        assert cluster.execute("SELECT count(*) FROM pg_database WHERE datname IN ('a', 'b', 'c')") == [(0,)]


def test_restart_kill_and_recover(pg_install: PgInstall) -> None:
    with Cluster(pg_install, name="crash") as cluster:
        cluster.execute("CREATE TABLE t (x int)")
        cluster.execute("INSERT INTO t VALUES (1)")
        cluster.restart()
        assert cluster.execute("SELECT x FROM t") == [(1,)]
        old_pid = cluster.pid
        cluster.kill()
        assert not cluster.running and _refuses(cluster.dsn())
        cluster.start()  # crash recovery
        assert cluster.pid != old_pid
        assert cluster.execute("SELECT x FROM t") == [(1,)]


def test_start_failure_reports_log(pg_install: PgInstall) -> None:
    cluster = Cluster(pg_install, name="broken", settings={"shared_buffers": "not-a-size"})
    try:
        with pytest.raises(RuntimeError, match="shared_buffers"):
            cluster.start()
    finally:
        cluster.stop()


def test_dsn_quoting(pg_install: PgInstall) -> None:
    cluster = Cluster(pg_install)
    try:
        assert cluster.dsn("a b", application_name="x'y") == (
            f"host=127.0.0.1 port={cluster.port} user=postgres dbname='a b' application_name='x\\'y'"
        )
        assert cluster.url("d/b").endswith(f"127.0.0.1:{cluster.port}/d%2Fb")
    finally:
        cluster.stop()


def test_scratch_databases(source_db: ScratchDb, target_db: ScratchDb, pg_install: PgInstall) -> None:
    assert source_db.cluster is not target_db.cluster
    assert source_db.cluster.port != target_db.cluster.port
    for db in (source_db, target_db):
        with psycopg.connect(db.dsn) as conn:
            row = conn.execute("SELECT current_database(), current_setting('server_version_num')::int").fetchone()
        assert row == (db.dbname, row[1]) and row[1] // 10000 == pg_install.version
    assert source_db.cluster.execute("SHOW wal_level") == [("logical",)]


def test_drop_database_with_active_slot(pg_source: Cluster) -> None:
    """The teardown path: an active pg_recvlogical holds a slot; drop_database still works."""
    dbname = "drop_me_active"
    pg_source.create_database(dbname)
    pg_source.execute("CREATE PUBLICATION p FOR ALL TABLES", dbname=dbname)
    pg_source.execute("SELECT pg_create_logical_replication_slot('held', 'pgoutput')", dbname=dbname)
    pg_source.execute("SELECT pg_create_logical_replication_slot('idle', 'pgoutput')", dbname=dbname)
    recv = subprocess.Popen(
        [
            str(pg_source.install.bin("pg_recvlogical")),
            "-d",
            pg_source.dsn(dbname),
            "-S",
            "held",
            "--start",
            "--no-loop",
            "-f",
            "-",
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=p",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while not pg_source.execute("SELECT active FROM pg_replication_slots WHERE slot_name = 'held'")[0][0]:
            assert recv.poll() is None, recv.stderr.read() if recv.stderr else ""
            assert time.monotonic() < deadline, "pg_recvlogical never activated the slot"
            time.sleep(0.05)
        pg_source.drop_database(dbname)
        assert pg_source.execute("SELECT count(*) FROM pg_database WHERE datname = %s", params=[dbname]) == [(0,)]
        slots = pg_source.execute("SELECT count(*) FROM pg_replication_slots WHERE database = %s", params=[dbname])
        assert slots == [(0,)]
        recv.wait(timeout=10)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def test_the_tests_temporary_files_go_to_memory_unless_tmpdir_says_otherwise(tmp_path: Path,
                                                                              request: pytest.FixtureRequest) -> None:
    """tests/conftest.py's choice: a tmpfs with room when TMPDIR is not set; TMPDIR, or the default, otherwise."""
    assert memory_tmp({"TMPDIR": str(tmp_path)}) is None  # the user's choice stands
    assert memory_tmp({}, shm=str(tmp_path / "missing")) is None
    if request.config.option.basetemp is None and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        # what conftest chose reaches this worker's temporary files (the servers' directories are made the same way)
        assert str(tmp_path).startswith(os.path.realpath(tempfile.gettempdir()) + "/")
    if os.environ.get("TMPDIR") == SHM:
        assert tempfile.gettempdir() == SHM
