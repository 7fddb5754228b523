"""Tables that start to be published while applier runs (``apply.new_tables``): joined without an operator.

What a user relies on: with "sync", a table added to the publication with rows (while a writer keeps
committing to it and to another table) is copied at a snapshot and joined by ``applier run`` itself, and
ends equal to the source, each row once; a table created in a FOR ALL TABLES publication (no DDL
capture) is created and joined the same way; with "error", ``catchup`` stops with one line naming the
table, the LSN and both ways out. "wait" is covered by ``test_add_table`` (unchanged).

How each test fails without ``applier.engine.newtables`` (checked by making ``JoinGate.missing`` ignore
``apply.new_tables``): the daemon waits for `applier sync --table` for ever (the target never equals the
source) and ``catchup`` ends 0 with the old line instead of the "error" line.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.sandbox.clusters import find_install
from tests.plugins.cli import invoke, write_toml
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db
from tests.spark.conftest import target_exec
from tests.spark.test_add_table import (
    SOURCE,
    Writer,
    cli,
    equal_then_stop,
    start_daemon,
    sync_state,
    synced,
    synced_and_running,
    wait_for,
)

pytest.importorskip("pyspark")


def config_file(path: Path, src: ScratchDb, target_url: str, work: Path, new_tables: str,
                publications: tuple[str, ...] = ("pub",)) -> Path:
    return write_toml(path, {
        "source": {"dsn": src.dsn, "slot": "applier", "publications": list(publications), "status_interval": 1.0},
        "target": {"url": target_url},
        "apply": {"work_dir": str(work), "retry_initial": 0.1, "retry_max": 1.0, "on_error": "stop",
                  "group_commit_delay": 0.05, "new_tables": new_tables},
        "spark": {"master": "local[2]", "partitions": 2},
    })


def joined(log: Path) -> None:
    """Wait until the daemon says that its join of n ended well."""
    wait_for("the join of n", lambda: "source table public.n joined the stream" in log.read_text(), seconds=300)


def test_sync_joins_a_table_added_with_rows(spark: Any, src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work", "sync")
    log = tmp_path / "daemon.log"
    daemon = synced_and_running(spark, src, cfg_file, log)
    writer = Writer(src.dsn)
    writer.start()
    try:
        writer.pause(1.0)
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        writer.pause(3.0)
    finally:
        writer.stop()
    joined(log)
    text = equal_then_stop(src, target_url, daemon, log)
    assert "source table public.n starts to be published (at LSN" in text, text
    assert "source table public.n joined the stream" in text, text
    assert "apply failed" not in text and "ERROR" not in text, text


def test_sync_joins_a_table_created_in_a_for_all_tables_publication(spark: Any, src: ScratchDb, dst: ScratchDb,
                                                                     tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL);"
                        "INSERT INTO a SELECT g, 0 FROM generate_series(1, 1000) g;"
                        "CREATE PUBLICATION pub FOR ALL TABLES;", src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work", "sync")
    synced(spark, cfg_file)
    log = tmp_path / "daemon.log"
    daemon = start_daemon(cfg_file, log)
    src.cluster.execute("CREATE TABLE n (id int PRIMARY KEY, v int NOT NULL, note text)", src.dbname)
    writer = Writer(src.dsn)
    writer.next_id = 1
    writer.start()
    try:
        writer.pause(3.0)
    finally:
        writer.stop()
    joined(log)
    text = equal_then_stop(src, dst.url, daemon, log)
    assert "source table public.n joined the stream" in text, text


def test_error_names_the_table_the_lsn_and_the_ways_out(src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work", "error")
    dst.cluster.execute("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL)", dst.dbname)  # no copy needed: init
    first = invoke("init", "-c", str(cfg_file))  # set-up: in this process
    assert first.returncode == 0, first.stderr
    src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n; UPDATE n SET v = 1 WHERE id = 1", src.dbname)
    res: subprocess.CompletedProcess[Any] = cli("catchup", "-c", str(cfg_file))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "source table public.n is published but target table" in line, line
    assert "(a change at LSN " in line and "apply.new_tables = \"error\"" in line, line
    assert "`applier sync --table public.n`" in line and "apply.new_tables = \"sync\"" in line, line


def test_sync_join_survives_a_sigkill_of_the_daemon(spark: Any, src: ScratchDb, dst: ScratchDb,
                                                    tmp_path: Path) -> None:
    """SIGKILLed while its join copies, the daemon started again ends equal to the source, each row once."""
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work", "sync")
    log = tmp_path / "daemon.log"
    daemon = synced_and_running(spark, src, cfg_file, log)
    writer = Writer(src.dsn)
    writer.start()
    try:
        writer.pause(1.0)
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        wait_for("the copy of n", lambda: sync_state(dst.url) == "copying")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(30)
        writer.pause(1.0)
        daemon = start_daemon(cfg_file, log)
        wait_for("n to be ready", lambda: sync_state(dst.url) == "ready", seconds=240)
        writer.pause(2.0)
    finally:
        writer.stop()
    text = equal_then_stop(src, dst.url, daemon, log)
    assert "apply failed" not in text and "ERROR" not in text, text


BIG_ROWS = 100_000


class TickWriter(threading.Thread):
    """Source transactions until stopped, each a tick (its commit time, as the source's clock says) and, once
    ``big`` is published, a new row and an update of it: the other table's lag and the joining table's changes."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True, name="ticks")
        self.dsn = dsn
        self.halt = threading.Event()
        self.next_id = BIG_ROWS + 1
        self.big = threading.Event()  # big exists: write to it too
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.halt.is_set():
                    with conn.transaction():
                        conn.execute("INSERT INTO tick (at) VALUES (extract(epoch FROM clock_timestamp()))")
                        if self.big.is_set():
                            conn.execute("INSERT INTO big VALUES (%s, 'new')", [self.next_id])
                            conn.execute("UPDATE big SET note = note || '+' WHERE id = %s", [self.next_id // 2])
                            self.next_id += 1
                    time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error


def tick_lag(src: ScratchDb, target_url: str) -> float:
    """How far the target's newest tick is behind the source's clock now (seconds)."""
    (now,) = src.cluster.execute("SELECT extract(epoch FROM clock_timestamp())::float8", src.dbname)[0]
    try:
        (newest,) = target_exec(target_url, "SELECT max(at) FROM tick")[0]
    except Exception:  # noqa: BLE001 - SQLite may be busy: counted as no progress
        return float("inf")
    return float(now) - float(newest or 0)


@pytest.mark.parametrize(("version", "target_kind", "how"), [
    (15, "sqlite", "added"), (18, "postgresql", "added"), (18, "sqlite", "FOR ALL TABLES"),
    (15, "postgresql", "FOR TABLES IN SCHEMA public")], ids=["pg15-sqlite-added", "pg18-postgresql-added",
                                                           "pg18-sqlite-all-tables", "pg15-postgresql-in-schema"])
def test_other_tables_keep_flowing_while_a_100k_row_table_joins(
        version: int, target_kind: str, how: str, pg_clusters: ClusterPool, newest_target: Any,
        tmp_path: Path) -> None:
    """A table that starts to be published while a writer commits to it and to another table (one of 100,000 rows
    added to the publication, or one created and filled in a FOR ALL TABLES or TABLES IN SCHEMA publication,
    without DDL capture): the other table's lag stays under 2 seconds from the new table's first change to the end of its
    copy (its changes are not held behind the copy), the new table's changes are held on the target meanwhile and
    applied once its copy is ready (those before the copy's snapshot skipped), and both end equal to the source,
    each row once."""
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(scratch_db(pg_clusters.get(find_install(version), "source"), "src"))
        target_url = (f"sqlite:///{tmp_path / 'replica.db'}" if target_kind == "sqlite"
                      else stack.enter_context(scratch_db(newest_target, "tgt")).url)
        # added: 100,000 rows copied; created: a table of 1,000 rows made by one transaction in the stream (not
        # larger: a transaction is applied in commit order, however large, so the other tables would wait for it)
        rows = BIG_ROWS if how == "added" else 1000
        make_big = ("CREATE TABLE big (id int PRIMARY KEY, note text NOT NULL);"
                    f"INSERT INTO big SELECT g, repeat('x', 100) FROM generate_series(1, {rows}) g;")
        src.cluster.execute("CREATE TABLE tick (id serial PRIMARY KEY, at float8 NOT NULL);"
                            + (make_big + "CREATE PUBLICATION pub FOR TABLE tick;" if how == "added"
                               else f"CREATE PUBLICATION pub {how};"), src.dbname)
        cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work", "sync")
        target_exec(target_url, "CREATE TABLE tick (id int PRIMARY KEY, at float8 NOT NULL)")  # as pg_dump makes it
        first = invoke("init", "-c", str(cfg_file))  # set-up: in this process
        assert first.returncode == 0, first.stderr
        log = tmp_path / "daemon.log"
        daemon = start_daemon(cfg_file, log)
        writer = TickWriter(src.dsn)
        writer.next_id = rows + 1
        if how == "added":
            writer.big.set()
        writer.start()
        lags: list[float] = []
        try:
            wait_for("the daemon to follow", lambda: tick_lag(src, target_url) < 1.0)
            src.cluster.execute("ALTER PUBLICATION pub ADD TABLE big" if how == "added" else make_big, src.dbname)
            writer.big.set()
            deadline = time.monotonic() + 240
            while sync_state(target_url, "big") != "ready":  # from its first change to the end of its copy
                lags.append(tick_lag(src, target_url))
                assert daemon.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the copy of big did not end in 4 minutes"
                time.sleep(0.02)  # as often as the writer commits: a copy of a second gives ~25 samples
            time.sleep(1.0)
        finally:
            writer.stop()
        try:
            for select in ("SELECT id, at FROM tick ORDER BY id", "SELECT id, note FROM big ORDER BY id"):
                want = src.cluster.execute(select, src.dbname)
                wait_for("the target to equal the source", lambda s=select, w=want: target_exec(target_url, s) == w)
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(60)
        text = log.read_text()
        assert code == 0, text
        assert target_exec(target_url, "SELECT count(*) FROM applier_held") == [(0,)]
    assert len(lags) > 10 and max(lags) < 2.0, f"the lag of tick during the join of big: max {max(lags):.2f} s"
    assert "its changes are held on the target (applier_held) until the copy is ready" in text, text
    assert "table public.big: its copy is ready; the changes held meanwhile are applied" in text, text
    assert "apply failed" not in text and "ERROR" not in text, text
