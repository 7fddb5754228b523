"""How ``applier sync`` and ``applier verify`` start Spark's driver on a local master, as an operator sees it.

What a user relies on: the first Spark command leaves the driver JVM's class-data archive in the cache
(``$XDG_CACHE_HOME/applier``: one archive, nothing half-written beside it); a later command's driver JVM maps it
and runs with the JIT's C1 only and the serial collector; the commands do their work as before (sync copies,
verify agrees). A sync that copies every table itself (each small, or a master of one copy stream) starts no
JVM.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from applier.migrate.sync import DRIVER_PAGES
from applier.progress.migrate import migrate
from tests.plugins.cli import PROBE, applier_script, clean_env, write_toml
from tests.plugins.clusters import ScratchDb

pytest.importorskip("pyspark")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _driver_jvm(proc: subprocess.Popen[str], mapped: str, deadline: float) -> tuple[str, str]:
    """(command line, mapped files) of ``proc``'s driver JVM (its child running SparkSubmit): as soon as it maps
    ``mapped``, else as last seen while it ran (until ``deadline``)."""
    seen = None
    while time.monotonic() < deadline and proc.poll() is None:
        for child in _children(proc.pid):
            try:
                cmdline = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                maps = (Path("/proc") / str(child) / "maps").read_text()
            except OSError:
                continue
            if "org.apache.spark.deploy.SparkSubmit" in cmdline:
                seen = cmdline, maps
                if mapped in maps:
                    return seen
        time.sleep(0.1)
    assert seen is not None, f"no driver JVM under pid {proc.pid}: {proc.communicate()}"
    return seen


def _config(tmp_path: Path, src: ScratchDb, dst: ScratchDb, slot: str, master: str, partitions: int) -> Path:
    return write_toml(tmp_path / "applier.toml", {
        "source": {"dsn": src.dsn, "slot": slot, "publications": ["pub"]}, "target": {"url": dst.url},
        "apply": {"work_dir": str(tmp_path / "work")}, "spark": {"master": master, "partitions": partitions}})


def test_the_first_command_leaves_the_class_archive_that_the_next_one_maps(src: ScratchDb, dst: ScratchDb,
                                                                             tmp_path: Path) -> None:
    # more than a sync copies in its driver (DRIVER_PAGES), on a master of two copy streams: a Spark job's
    src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (id int PRIMARY KEY, v text); "
                        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 250000) g; "
                        "INSERT INTO u SELECT g, 'u' || g FROM generate_series(1, 10) g; "
                        "CREATE PUBLICATION pub FOR TABLE t, u", src.dbname)
    cfg = _config(tmp_path, src, dst, "start", "local[4]", 1)
    cache = tmp_path / "cache"
    env = {**clean_env(), "XDG_CACHE_HOME": str(cache)}
    env.pop("SPARK_SUBMIT_OPTS", None)
    try:
        sync = subprocess.run([applier_script(), "sync", "-q", "-c", str(cfg)], capture_output=True, text=True,
                              env=env, timeout=600, stdin=subprocess.DEVNULL)
        assert sync.returncode == 0, sync.stderr
        assert "synced 250,010 rows in 2 tables" in sync.stdout, sync.stdout
        archives = sorted(p.name for p in (cache / "applier").iterdir())
        assert len(archives) == 1 and archives[0].startswith("spark-driver-") and archives[0].endswith(".jsa"), \
            archives
        archive = cache / "applier" / archives[0]

        # a column declared otherwise on the target: that table's rows are read into Spark (t, which the servers
        # find equal, needs no Spark on a local master; u's 10 rows start the driver all the same)
        dst.cluster.execute("ALTER TABLE u ALTER COLUMN v TYPE varchar(40)", dst.dbname)
        verify = subprocess.Popen([applier_script(), "verify", "-c", str(cfg)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
        try:
            cmdline, maps = _driver_jvm(verify, str(archive), time.monotonic() + 300)
            out, err = verify.communicate(timeout=600)
        finally:
            if verify.poll() is None:
                verify.kill()
                verify.wait()
        assert verify.returncode == 0, out + err
        assert out.splitlines()[-1] == "verify: the source and the target agree", out
        assert "public.t: OK, 250,000 rows" in out and "public.u: OK, 10 rows" in out, out
        assert "-XX:TieredStopAtLevel=1" in cmdline and "-XX:+UseSerialGC" in cmdline, cmdline
        assert str(archive) in maps, f"{archive} not mapped by the driver JVM: {cmdline}"
        assert sorted(p.name for p in (cache / "applier").iterdir()) == archives
    finally:
        src.cluster.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                            "WHERE slot_name = 'start'", src.dbname)


@pytest.mark.parametrize(("master", "rows"), [("local[4]", 2000), ("local[2]", 300000)],
                         ids=["small-tables", "one-copy-stream"])
def test_a_sync_the_command_copies_itself_starts_no_spark(src: ScratchDb, dst: ScratchDb, tmp_path: Path, master: str,
                                                          rows: int) -> None:
    """On a local master, tables of at most DRIVER_PAGES each (on local[4], two copy streams), or of any size where
    the master copies one stream at a time (local[2]), into a target whose control tables are current: the command
    copies them itself (a Spark job costs more than a small copy, and would run one stream's task on this machine
    anyway), never imports pyspark (so starts no JVM) nor pyarrow, alembic or SQLAlchemy, and ends with the rows and
    keys on the target."""
    src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (id int PRIMARY KEY); "
                        f"INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, {rows}) g; "
                        "INSERT INTO u SELECT generate_series(1, 10); CREATE PUBLICATION pub FOR TABLE t, u", src.dbname)
    [(pages,)] = src.cluster.execute("SELECT pg_relation_size('t') / 8192", src.dbname)
    assert (pages > DRIVER_PAGES) == (rows > 2000), pages
    migrate(dst.url)
    cfg = _config(tmp_path, src, dst, "small", master, 2)
    modules = tmp_path / "modules.txt"
    try:
        sync = subprocess.run([sys.executable, "-c", PROBE, str(modules), "sync", "-q", "-c", str(cfg)],
                              capture_output=True, text=True, env=clean_env(), timeout=600, stdin=subprocess.DEVNULL)
        assert sync.returncode == 0, sync.stderr
        assert f"synced {rows + 10:,} rows in 2 tables" in sync.stdout, sync.stdout
        loaded = set(modules.read_text().split())
        assert "applier.migrate.sync" in loaded  # the list is the real one
        assert sorted(m for m in loaded if m.split(".")[0] in ("pyspark", "py4j", "pyarrow", "alembic",
                                                               "sqlalchemy")) == []
        assert dst.cluster.execute("SELECT count(*), sum(id) FROM t", dst.dbname) == [(rows, rows * (rows + 1) // 2)]
        assert dst.cluster.execute("SELECT conrelid::regclass::text FROM pg_constraint WHERE contype = 'p' "
                                   "AND conrelid::regclass::text IN ('t', 'u') ORDER BY 1", dst.dbname) == [
            ("t",), ("u",)]
    finally:
        src.cluster.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                            "WHERE slot_name = 'small'", src.dbname)
