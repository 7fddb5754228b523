"""``applier verify`` against a PostgreSQL target hashes the key ranges on the servers: rows stay there.

What a user relies on, and can check in Spark's status (the input records of every task, as the Spark UI and
its event log show them): verifying a large table reads into Spark only the rows of the key ranges that
differ, yet the report names every differing key (a changed value, a missing row, an extra row) with both
sides' values, as before. A table whose target column is declared otherwise is compared by reading its rows
(the canonical text of a value may depend on its type), and still agrees. Small tables are hashed together, in
one Spark job (a job per table would cost a schema of many small tables more than their rows). On a local master
the command asks the servers for those sums itself: verifying tables that agree runs no Spark job and needs no
Java, and a difference is still named from the rows Spark reads of its ranges.

verify runs in this process on the shared session (``spark``): the report's lines and status are what
``applier verify`` prints and exits with (tests/spark/test_failures.py runs the command); the records read
are summed from Spark's status store over the stages of verify's own jobs.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.config import Config
from applier.migrate.spark.rangehash import Running
from applier.migrate.spark.verify import VerifyReport, verify
from applier.migrate.sync import DRIVER_PAGES, sync
from tests.plugins.cli import ctrl_c, foreground, run_cli, write_toml
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

ROWS = 60_000  # big is over DRIVER_PAGES (8 MB): read into Spark, its rows would be read by Spark's tasks
DECLARED = 5_000

SOURCE = f"""
CREATE TABLE big (id bigint PRIMARY KEY, v text, f double precision, n numeric(12,3), at timestamptz,
    span interval, raw bytea, tags text[]);
INSERT INTO big SELECT g, CASE WHEN g % 9 = 0 THEN NULL WHEN g % 11 = 0 THEN '' ELSE 'v,"' || g || E'\\n' END,
    g / 7.0, g / 3.0, timestamptz '2024-01-01 00:00+02' + g * interval '1 s', g * interval '1 minute',
    decode(md5(g::text), 'hex'), ARRAY['a' || g, NULL]
  FROM generate_series(1, {ROWS}) g;
CREATE TABLE declared (id int PRIMARY KEY, v varchar(20));
INSERT INTO declared SELECT g, 'd' || g FROM generate_series(1, {DECLARED}) g;
CREATE PUBLICATION pub FOR TABLE big, declared;
"""


def _verify(spark: Any, cfg: Config) -> tuple[VerifyReport, int, int]:
    """verify on the shared session: (its report, the input records of all tasks of its jobs, its jobs)."""
    group = f"verify-{uuid.uuid4().hex}"
    sc = spark.sparkContext
    sc.setJobGroup(group, "test_verify_on_servers")
    try:
        report = verify(cfg, spark=spark)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    sc._jsc.sc().listenerBus().waitUntilEmpty()  # the status store has every task's end
    store = sc._jsc.sc().statusStore()
    tracker = sc.statusTracker()
    jobs = tracker.getJobIdsForGroup(group)
    stages = {s for job in jobs for s in tracker.getJobInfo(job).stageIds}
    return report, sum(store.lastStageAttempt(s).inputRecords() for s in stages), len(jobs)


def test_verify_hashes_key_ranges_on_the_servers_and_names_the_differing_keys(
        spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work", partitions=4)
    assert sync(cfg, spark=spark).rows == ROWS + DECLARED
    # the target declares a column otherwise: that table's rows are read (and agree)
    dst.cluster.execute("ALTER TABLE declared ALTER COLUMN v TYPE text", dst.dbname)

    report, read, _ = _verify(spark, cfg)
    assert report.status == 0, report.lines()
    assert report.lines()[-3:] == [f"public.big: OK, {ROWS:,} rows, 1024 key ranges agree",
                                   f"public.declared: OK, {DECLARED:,} rows, 1024 key ranges agree",
                                   "verify: the source and the target agree"]
    # no Spark task read a row: declared's are read by the driver (small: verify.read_here), and big is summed on
    # the servers (were it read into Spark instead, its size would have Spark's tasks read it: counted here)
    assert read == 0
    [(pages,)] = src.cluster.execute("SELECT pg_relation_size('big') / 8192", src.dbname)
    assert pages > DRIVER_PAGES, pages

    dst.cluster.execute("UPDATE big SET f = 0.5 WHERE id = 1234; DELETE FROM big WHERE id = 5678; "
                        "INSERT INTO big (id, v) VALUES (9999999, 'extra')", dst.dbname)
    report, read, _ = _verify(spark, cfg)
    assert report.status == 1, report.lines()
    out = report.lines()
    assert f"public.big: DIFFERENT: source {ROWS:,} rows, target {ROWS:,} rows; 3 of 1024 key ranges differ; " \
           "3 differing keys (1 missing on the target, 1 extra on the target, 1 changed)" in out, out
    assert "  (id)=('1234'): f: source '176.28571428571428', target '0.5'" in out, out
    assert any(line.startswith("  (id)=('5678'): missing on the target; source row {id: '5678', v: 'v,\"5678\\n'")
               for line in out), out
    assert "  (id)=('9999999'): extra on the target; target row {id: '9999999', v: 'extra', f: NULL, n: NULL, " \
           "at: NULL, span: NULL, raw: NULL, tags: NULL}" in out, out
    assert out[-1] == "verify: the source and the target DIFFER in public.big (1 of 2 tables)"
    # Spark's tasks read the rows of the three differing key ranges of big (about 3/1024 of each side), no others
    assert 0 < read < 6 * ROWS // 100, read


SMALL = "".join(f"CREATE TABLE s{i} (id int PRIMARY KEY, v text); "
                f"INSERT INTO s{i} SELECT g, 's' || g FROM generate_series(1, 100) g;\n" for i in range(5)) \
    + "CREATE PUBLICATION pub FOR TABLE s0, s1, s2, s3, s4;"


def test_small_tables_are_hashed_on_the_servers_in_one_job(spark, src: ScratchDb, dst: ScratchDb,
                                                          tmp_path: Path) -> None:
    """On a cluster master the servers' sums are a Spark job (on a local master the driver asks for them: the test
    below); the config names a cluster, the shared local session runs its jobs."""
    src.cluster.execute(SMALL, src.dbname)
    assert sync(make_config(src, dst.url, tmp_path / "work"), spark=spark).rows == 500
    cfg = make_config(src, dst.url, tmp_path / "work", **{"spark.master": "spark://cluster.invalid:7077"})

    report, read, jobs = _verify(spark, cfg)
    assert report.status == 0 and len(report.tables) == 5, report.lines()
    assert (read, jobs) == (0, 1)  # no row read into Spark; one job for the five tables

    dst.cluster.execute("UPDATE s3 SET v = 'changed' WHERE id = 42", dst.dbname)
    report, read, jobs = _verify(spark, cfg)
    out = report.lines()
    assert "public.s2: OK, 100 rows, 1024 key ranges agree" in out, out
    assert "  (id)=('42'): v: source 's42', target 'changed'" in out, out
    assert out[-1] == "verify: the source and the target DIFFER in public.s3 (1 of 5 tables)"
    assert 0 < read <= 2 * 100 and jobs > 1  # then s3's differing range, read by its job 2


def test_on_a_local_master_tables_that_agree_are_verified_without_spark(spark, src: ScratchDb, dst: ScratchDb,
                                                                       tmp_path: Path) -> None:
    """`applier verify` on a local master, a PostgreSQL target: the servers' sums are the command's own queries, so
    tables that agree are verified with no Java to start Spark with (a Spark start would fail: exit 2), with a
    connection a side for the sums of all the tables; one range that differs is read into Spark (job 2, on the
    shared session here) and its key named."""
    src.cluster.execute(SMALL, src.dbname)
    assert sync(make_config(src, dst.url, tmp_path / "work"), spark=spark).rows == 500
    cfg_file = write_toml(tmp_path / "applier.toml", {
        "source": {"dsn": src.dsn, "slot": "applier", "publications": ["pub"]}, "target": {"url": dst.url},
        "apply": {"work_dir": str(tmp_path / "work")}, "spark": {"master": "local[2]", "partitions": 2}})
    before = src.sessions(), dst.sessions()
    res = run_cli("verify", "-c", str(cfg_file), env={"JAVA_HOME": str(tmp_path / "no-java")}, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout.splitlines()
    assert [line for line in out if line.startswith("public.")] == [
        f"public.s{i}: OK, 100 rows, 1024 key ranges agree" for i in range(5)], res.stdout
    assert out[-1] == "verify: the source and the target agree"
    # each side's sums of the five tables on one connection (local[2]: two threads, a side each), not one a table:
    # with the command's own (its checks, the snapshot's catalog), 7 sessions a side (11 when it was one a table)
    opened = src.sessions() - before[0], dst.sessions() - before[1]
    assert max(opened) <= 7, opened

    dst.cluster.execute("DELETE FROM s1 WHERE id = 7", dst.dbname)
    report, read, jobs = _verify(spark, make_config(src, dst.url, tmp_path / "work"))
    out = report.lines()
    assert "  (id)=('7'): missing on the target; source row {id: '7', v: 's7'}" in out, out
    assert out[-1] == "verify: the source and the target DIFFER in public.s1 (1 of 5 tables)"
    assert 0 < read <= 2 * 100 and jobs >= 1  # only s1's differing range, read by its job 2


def test_spark_that_cannot_start_fails_the_command_not_a_table(spark, src: ScratchDb, dst: ScratchDb,
                                                               tmp_path: Path) -> None:
    """Tables to be read into Spark (a column declared otherwise on the target) and no Java: the command fails with
    one line, Spark's start as the cause (exit 2, no traceback); no table is reported as not compared for it."""
    src.cluster.execute(SMALL, src.dbname)
    assert sync(make_config(src, dst.url, tmp_path / "work"), spark=spark).rows == 500
    dst.cluster.execute("ALTER TABLE s1 ALTER COLUMN v TYPE varchar(40); ALTER TABLE s3 ALTER COLUMN v TYPE "
                        "varchar(40)", dst.dbname)
    cfg_file = write_toml(tmp_path / "applier.toml", {
        "source": {"dsn": src.dsn, "slot": "applier", "publications": ["pub"]}, "target": {"url": dst.url},
        "apply": {"work_dir": str(tmp_path / "work")}, "spark": {"master": "local[2]", "partitions": 2}})
    res = run_cli("verify", "-c", str(cfg_file), env={"JAVA_HOME": str(tmp_path / "no-java")}, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.splitlines()[-1] == (
        "applier: error: Spark could not start with master 'local[2]': [JAVA_GATEWAY_EXITED] Java gateway process "
        "exited before sending its port number.; no Java found: Spark needs Java 17 (JAVA_HOME, or java on the "
        "PATH)"), res.stderr
    assert "Traceback" not in res.stderr and "could not compare" not in res.stdout + res.stderr, res.stderr


def test_the_drivers_tasks_stop_together_when_one_fails(src: ScratchDb) -> None:
    """The servers' sums run by the driver (a local master): when one task fails, the queries of the others under
    way are cancelled (the servers stop, the failure is raised at once), as a Spark job ends its tasks."""
    running = Running()

    def work(seconds: float) -> float:
        with psycopg.connect(src.dsn, autocommit=True) as conn, running.holding(conn):
            if seconds < 0:
                time.sleep(1)  # the others' queries are under way
                conn.execute("SELECT 1 / 0")
            conn.execute("SELECT pg_sleep(%s)", [seconds])
        return seconds

    assert running.run(work, [0.1, 0.2]) == [0.1, 0.2]
    running = Running()
    started = time.monotonic()
    with pytest.raises(psycopg.errors.DivisionByZero):
        running.run(work, [60, 60, -1])
    assert time.monotonic() - started < 30  # not the 60 s of the others' queries


def test_ctrl_c_while_the_servers_hash_ends_the_command_and_their_queries(spark, src: ScratchDb, dst: ScratchDb,
                                                                          tmp_path: Path) -> None:
    """Ctrl-C while the command's own threads wait on the servers' sums (a small table's, held back by a lock the
    test takes once verify has planned that table, while a larger one is compared): one line, exit 130, and the
    waiting query cancelled, not left to run once the lock is released."""
    src.cluster.execute(SMALL.replace("CREATE PUBLICATION pub FOR TABLE s0, s1, s2, s3, s4;", "")
                        + "CREATE TABLE t_big (id int PRIMARY KEY, v text); INSERT INTO t_big SELECT g, repeat('x', 80) "
                        "FROM generate_series(1, 150000) g; CREATE PUBLICATION pub FOR TABLE s0, s1, s2, s3, s4, t_big;",
                        src.dbname)
    assert src.cluster.execute("SELECT pg_relation_size('t_big') / 8192 > 1024", src.dbname) == [(True,)]
    assert sync(make_config(src, dst.url, tmp_path / "work"), spark=spark).rows == 150500
    cfg_file = write_toml(tmp_path / "applier.toml", {
        "source": {"dsn": src.dsn, "slot": "applier", "publications": ["pub"]}, "target": {"url": dst.url},
        "apply": {"work_dir": str(tmp_path / "work")}, "spark": {"master": "local[2]", "partitions": 2}})
    sums = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND query LIKE '%count(*), sum(%'")
    with psycopg.connect(dst.dsn) as lock:
        with foreground("verify", "-c", str(cfg_file)) as proc:
            assert proc.stderr is not None
            # a verify that never says so is ended (the read below then ends) rather than waited for forever
            watchdog = threading.Timer(180, proc.kill)
            watchdog.start()
            # s2 is planned (its size read: that waits on the lock too); the small tables' sums come after t_big's
            while (line := proc.stderr.readline()) and line.strip() != "comparing public.s2":
                pass
            watchdog.cancel()
            assert line, "verify ended before it compared s2"
            lock.execute("LOCK TABLE s2 IN ACCESS EXCLUSIVE MODE")
            deadline = time.monotonic() + 120
            while dst.cluster.execute(sums + " AND wait_event_type = 'Lock'", dst.dbname) != [(1,)]:
                assert proc.poll() is None and time.monotonic() < deadline, "verify did not wait on s2's lock"
                time.sleep(0.2)
            out, err = ctrl_c(proc, timeout=60)
        assert proc.returncode == 130, out + err
        assert "Traceback" not in err and err.rstrip().splitlines()[-1] == "applier: interrupted", err
        # cancelled while the lock is still held
        assert dst.cluster.execute(sums + " AND state = 'active'", dst.dbname) == [(0,)]
        lock.rollback()
    assert src.cluster.execute(sums + " AND state = 'active'", src.dbname) == [(0,)]
