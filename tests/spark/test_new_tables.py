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

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.cli import write_toml
from tests.plugins.clusters import ScratchDb
from tests.spark.test_add_table import SOURCE, Writer, cli, equal_then_stop, start_daemon, sync_state, wait_for

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
    wait_for("the join of n", lambda: "source table public.n joined the stream" in log.read_text())


def test_sync_joins_a_table_added_with_rows(src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work", "sync")
    first = cli("sync", "-c", str(cfg_file), "-q")
    assert first.returncode == 0, first.stderr
    log = tmp_path / "daemon.log"
    daemon = start_daemon(cfg_file, log)
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


def test_sync_joins_a_table_created_in_a_for_all_tables_publication(src: ScratchDb, dst: ScratchDb,
                                                                     tmp_path: Path) -> None:
    src.cluster.execute("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL);"
                        "INSERT INTO a SELECT g, 0 FROM generate_series(1, 1000) g;"
                        "CREATE PUBLICATION pub FOR ALL TABLES;", src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work", "sync")
    first = cli("sync", "-c", str(cfg_file), "-q")
    assert first.returncode == 0, first.stderr
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
    first = cli("init", "-c", str(cfg_file))
    assert first.returncode == 0, first.stderr
    src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n; UPDATE n SET v = 1 WHERE id = 1", src.dbname)
    res: subprocess.CompletedProcess[Any] = cli("catchup", "-c", str(cfg_file))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "source table public.n is published but target table" in line, line
    assert "(a change at LSN " in line and "apply.new_tables = \"error\"" in line, line
    assert "`applier sync --table public.n`" in line and "apply.new_tables = \"sync\"" in line, line


def test_sync_join_survives_a_sigkill_of_the_daemon(src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    """SIGKILLed while its join copies, the daemon started again ends equal to the source, each row once."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work", "sync")
    first = cli("sync", "-c", str(cfg_file), "-q")
    assert first.returncode == 0, first.stderr
    log = tmp_path / "daemon.log"
    daemon = start_daemon(cfg_file, log)
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
