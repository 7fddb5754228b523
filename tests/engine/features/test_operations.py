"""What an operator sees over a long life: a full work directory, outages, SIGTERM while retrying, progress.

Everything runs the installed ``applier`` script against the real clusters (newest
PostgreSQL, PostgreSQL target). A full disk is a real one: a 1 MB tmpfs mounted as
``apply.work_dir`` (needs root, as CI has; skipped otherwise), filled by a streamed
transaction (``logical_decoding_work_mem`` is 64kB on the test clusters, so a
transaction of a few thousand rows is streamed and spooled) of several MB.
"""

from __future__ import annotations

import os
import pty
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.decoder.messages import Commit, StreamCommit, StreamStart
from applier.engine.spool import SpoolFull
from applier.lsn import LSN
from tests.engine.test_crash import Daemon, wait_streaming
from tests.plugins.cli import applier_script, clean_env, run_cli

from .conftest import Rig

pytestmark = pytest.mark.parametrize("target_kind", ["postgresql"])

BIG_ROWS = 4000  # x ~1 kB a row: about 4 MB spooled, four times the tmpfs
PAD = 1000
DELAY = re.compile(r"(?:retrying in|waiting) ([0-9.]+)s")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("applier: error:")]


@pytest.fixture
def small_work_dir(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs to use as apply.work_dir; unmounted (if still mounted) at the end."""
    if os.geteuid() != 0:
        pytest.skip("a full work directory is tested on a small tmpfs, and mounting one needs root")
    work = tmp_path / "work"
    work.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(work)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield work
    finally:
        if os.path.ismount(work):
            subprocess.run(["umount", "-l", str(work)], check=False)


def streamed_table(rig: Rig) -> None:
    rig.both("CREATE TABLE t (id int PRIMARY KEY, pad text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (0, 'small')")


def big_transaction(rig: Rig) -> None:
    rig.src(f"INSERT INTO t SELECT g, repeat(md5(g::text), {PAD // 32}) FROM generate_series(1, {BIG_ROWS}) g")


def spool_files(work: Path) -> list[Path]:
    return sorted(work.rglob("stream-*.spool"))


def test_full_spool_disk_stops_catchup_in_one_line_and_resumes_once_there_is_room(
        cli_rig: Rig, small_work_dir: Path) -> None:
    rig = cli_rig
    streamed_table(rig)
    cfg = rig.config_file(apply_work_dir=str(small_work_dir), source_streaming=True)
    done = run_cli("catchup", "-c", str(cfg))
    assert done.returncode == 0, done.stderr
    applied = rig.progress_lsn()
    big_transaction(rig)

    failed = run_cli("catchup", "-c", str(cfg))
    assert failed.returncode == 2, failed.stderr
    assert "Traceback" not in failed.stderr, failed.stderr
    lines = error_lines(failed.stderr)
    assert len(lines) == 1 and failed.stderr.rstrip().splitlines()[-1] == lines[0], failed.stderr
    line = lines[0]
    assert "no space left" in line and "apply.work_dir" in line and str(small_work_dir) in line, line
    assert re.search(r"stream-\d+\.spool", line) and re.search(r"needs more than the [0-9.]+ [kM]?B", line), line
    assert spool_files(small_work_dir) == []  # the spool is gone: the disk is not left full
    assert rig.tgt("SELECT count(*) FROM t") == [(1,)]  # nothing of the big transaction
    assert rig.progress_lsn() == applied
    assert rig.slot_confirmed() <= applied
    assert rig.src("SELECT active FROM pg_replication_slots WHERE slot_name = %s", [rig.slot]) == [(False,)]

    subprocess.run(["umount", str(small_work_dir)], check=True)  # room: the work directory is on the big disk
    again = run_cli("catchup", "-c", str(cfg))
    assert again.returncode == 0, again.stderr
    assert rig.tgt("SELECT count(*), count(DISTINCT id), sum(length(pad)) FROM t") == \
        rig.src("SELECT count(*), count(DISTINCT id), sum(length(pad)) FROM t")
    assert rig.tgt("SELECT count(*) FROM t")[0][0] == BIG_ROWS + 1
    assert spool_files(small_work_dir) == []


@pytest.mark.parametrize("when", ["spooling", "at-its-commit"])
def test_a_full_spool_disk_commits_the_transactions_received_before_the_streamed_one_first(
        cli_rig: Rig, small_work_dir: Path, when: str) -> None:
    """A group of transactions still open when a later streamed transaction's spool fills the disk is committed
    before the error: what came before is not held back by room the later one needs. The server's own messages,
    handed to the engine in one go (as a catch-up reads a burst), so the group is still open at the failure: while
    the stream is spooled (a transaction four times the disk), or at its Stream Commit (one that fits, the disk
    filled by something else meanwhile: the spool's last buffered changes are written then)."""
    rig = cli_rig
    streamed_table(rig)  # (0, 'small'), committed before the big one
    rig.src("INSERT INTO t VALUES (-1, 'small too')")
    if when == "spooling":
        big_transaction(rig)
    else:
        rig.src(f"INSERT INTO t SELECT g, repeat(md5(g::text), {PAD // 32}) FROM generate_series(1, 350) g")
    received = rig.received(source_streaming=True)
    commits = [m for m, _ in received if isinstance(m, Commit)]
    assert len(commits) == 2 and any(isinstance(m, StreamStart) for m, _ in received)
    engine = rig.engine(work_dir=small_work_dir, group_delay=60.0)  # nothing commits the group but the engine
    try:
        with pytest.raises(SpoolFull, match="no space left for spool file"):
            for m, raw in received:
                if isinstance(m, StreamCommit):
                    (small_work_dir / "filler").write_bytes(b"x" * shutil.disk_usage(small_work_dir).free)
                    f = engine.spools.spools[m.xid]._f  # what it still buffers needs a page the disk lacks
                    size = os.fstat(f.fileno()).st_size
                    assert f.tell() - size > -size % 4096, "the spool's tail fits its last page: change the rows"
                engine.handle(m, raw)
        assert engine.stats.kept[:2] == (2, 2)  # the summary's: two transactions of a row each, committed
    finally:
        engine.close()
        engine.target.close()
    assert rig.tgt("SELECT id FROM t ORDER BY id") == [(-1,), (0,)]
    assert rig.progress_lsn() == commits[-1].end_lsn  # the position of the last whole transaction, in the same commit
    assert spool_files(small_work_dir) == []


def test_full_spool_disk_is_waited_out_by_the_daemon(cli_rig: Rig, small_work_dir: Path, tmp_path: Path) -> None:
    rig = cli_rig
    streamed_table(rig)
    cfg = rig.config_file(apply_work_dir=str(small_work_dir), source_streaming=True, apply_on_error="retry",
                          apply_retry_initial=0.2, apply_retry_max=1.0)
    daemon = Daemon(cfg, tmp_path / "daemon.log")
    try:
        daemon.start()
        wait_streaming(rig.source, daemon, None)
        big_transaction(rig)
        deadline = time.monotonic() + 60
        while daemon.text().count("no space left") < 2:  # it failed, waited and tried again
            assert daemon.proc.poll() is None, f"the daemon died on a full work directory:\n{daemon.tail()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, daemon.tail()
            time.sleep(0.1)
        assert "Traceback" not in daemon.text(), daemon.tail()
        assert rig.tgt("SELECT count(*) FROM t") == [(1,)]
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_work_dir)], check=True)
        deadline = time.monotonic() + 60
        while rig.tgt("SELECT count(*) FROM t") != [(BIG_ROWS + 1,)]:
            assert time.monotonic() < deadline, daemon.tail()
            time.sleep(0.1)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.tail()
    finally:
        daemon.ensure_dead()
    assert spool_files(small_work_dir) == []
    assert rig.tgt("SELECT count(DISTINCT id) FROM t") == [(BIG_ROWS + 1,)]


def test_retry_backoff_starts_over_after_each_outage(cli_rig: Rig, tmp_path: Path) -> None:
    """The walsender and then the target backend are terminated, twice each; between outages a transaction
    is applied. Each outage's first wait is retry_initial again, not the doubled wait of the one before."""
    rig = cli_rig
    assert rig.target is not None
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    cfg = rig.config_file(apply_on_error="retry", apply_retry_initial=0.2, apply_retry_max=5.0)
    daemon = Daemon(cfg, tmp_path / "daemon.log")
    first_waits = []
    try:
        daemon.start()
        pid = wait_streaming(rig.source, daemon, None)
        for i in range(1, 5):
            seen = len(daemon.text())
            if i % 2:
                rig.src("SELECT pg_terminate_backend(%s)", [pid])
                pid = wait_streaming(rig.source, daemon, pid)
            else:
                rig.target.cluster.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()", rig.target.dbname)
            rig.src("INSERT INTO t VALUES (%s)", [i])
            deadline = time.monotonic() + 30
            while rig.tgt("SELECT count(*) FROM t") != [(i,)]:
                assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.tail()  # type: ignore[union-attr]
                time.sleep(0.05)
            waits = DELAY.findall(daemon.text()[seen:])
            assert waits, f"outage {i} was not retried:\n{daemon.tail()}"
            first_waits.append(float(waits[0]))
            pid = wait_streaming(rig.source, daemon, None)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.tail()
    finally:
        daemon.ensure_dead()
    assert first_waits == [0.2] * 4, f"first wait of each outage: {first_waits}\n{daemon.tail()}"


def test_sigterm_while_retrying_a_failing_transaction_reports_the_applied_position(cli_rig: Rig,
                                                                                   tmp_path: Path) -> None:
    rig = cli_rig
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v int)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v int CHECK (v >= 0))")  # only the target refuses
    rig.publish("t")
    rig.init()
    for i in range(1, 4):
        rig.src("INSERT INTO t VALUES (%s, %s)", [i, i])
    rig.src("INSERT INTO t VALUES (4, -1)")  # fails on the target, again and again
    cfg = rig.config_file(apply_on_error="retry", apply_retry_initial=5.0, apply_retry_max=5.0)
    daemon = Daemon(cfg, tmp_path / "daemon.log")
    try:
        daemon.start()
        deadline = time.monotonic() + 60
        while "retrying in" not in daemon.text():
            assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.tail()  # type: ignore[union-attr]
            time.sleep(0.05)
        daemon.signal(signal.SIGTERM)  # while it waits to retry
        assert daemon.wait(30) == 0, daemon.tail()
    finally:
        daemon.ensure_dead()
    summary = [line for line in daemon.text().splitlines() if line.startswith("applied ")]
    assert len(summary) == 1, daemon.tail()
    m = re.search(r"target at ([0-9A-F]+/[0-9A-F]+)", summary[0])
    assert m, summary[0]
    recorded = rig.progress_lsn()
    assert rig.tgt("SELECT id FROM t ORDER BY id") == [(1,), (2,), (3,)]
    assert recorded > LSN(0) and LSN.parse(m.group(1)) == recorded, (summary[0], recorded)


def test_daemon_logs_a_heartbeat_at_the_configured_interval(cli_rig: Rig, tmp_path: Path) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    cfg = rig.config_file(apply_heartbeat_interval=1.0)
    daemon = Daemon(cfg, tmp_path / "daemon.log")
    try:
        daemon.start()
        wait_streaming(rig.source, daemon, None)
        for i in range(40):
            rig.src("INSERT INTO t SELECT g FROM generate_series(%s::int, %s::int) g", [i * 100, i * 100 + 99])
            time.sleep(0.1)
        time.sleep(1.0)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.tail()
    finally:
        daemon.ensure_dead()
    beats = [line for line in daemon.text().splitlines() if "heartbeat: target at" in line]
    assert len(beats) >= 3, daemon.tail()
    times = [time.mktime(time.strptime(b[:19], "%Y-%m-%d %H:%M:%S")) + int(b[20:23]) / 1000 for b in beats]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(0.9 <= g <= 2.5 for g in gaps), (gaps, beats)
    assert re.search(r"target at [0-9A-F]+/[0-9A-F]+, [0-9.]+ [kMG]?B behind the source's [0-9A-F]+/[0-9A-F]+, "
                     r"[0-9,]+ rows, [0-9,]+ rows/s", beats[-1]), beats[-1]
    assert int(beats[-1].split(" rows,")[0].rsplit(" ", 1)[-1].replace(",", "")) > 0, beats[-1]
    assert "heartbeat" not in run_cli("catchup", "-c", str(cfg)).stderr  # catchup reports toward its goal


def backlog(rig: Rig, transactions: int) -> Rig:
    """Table t published and ``transactions`` transactions of 5,000 rows waiting in the slot."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, pad text)")
    rig.publish("t")
    rig.init()
    for i in range(transactions):
        rig.src("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(%s::int, %s::int) g", [i * 5000, i * 5000 + 4999])
    return rig


def test_catchup_of_a_backlog_prints_progress_lines_when_not_on_a_terminal(cli_rig: Rig) -> None:
    rig = backlog(cli_rig, 40)
    cfg = rig.config_file(apply_heartbeat_interval=0.2)
    done = run_cli("catchup", "-c", str(cfg))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "catching up: target at" in line]
    assert len(lines) >= 2, done.stderr
    goal = re.search(r"goal ([0-9A-F]+/[0-9A-F]+)", done.stdout)
    assert goal, done.stdout
    positions = [LSN.parse(m) for m in re.findall(r"target at ([0-9A-F]+/[0-9A-F]+) of goal", "\n".join(lines))]
    rows = [int(n.replace(",", "")) for n in re.findall(r"\), ([0-9,]+) rows,", "\n".join(lines))]
    assert len(rows) == len(lines) and rows[-1] > rows[0], lines  # the lines follow the work as it goes
    assert positions == sorted(positions) and positions[0] < LSN.parse(goal.group(1)), lines
    assert all(f"of goal {goal.group(1)} (" in line and "rows/s" in line for line in lines), lines
    quiet = rig.config_file("quiet.toml", apply_heartbeat_interval=0)
    rig.src("INSERT INTO t SELECT g, 'x' FROM generate_series(200000, 299999) g")
    silent = run_cli("catchup", "-c", str(quiet))
    assert silent.returncode == 0 and "catching up: target at" not in silent.stderr, silent.stderr


def test_catchup_on_a_terminal_draws_a_bar(cli_rig: Rig) -> None:
    rig = backlog(cli_rig, 30)
    cfg = rig.config_file()
    master, slave = pty.openpty()  # stderr is a terminal, stdout is not
    try:
        proc = subprocess.Popen([applier_script(), "catchup", "-c", str(cfg)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=slave, env={**clean_env(), "COLUMNS": "160"})
        os.close(slave)
        screen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end is closed: the process is done
                break
            if not chunk:
                break
            screen += chunk
        out, _ = proc.communicate(timeout=120)
    finally:
        os.close(master)
    text = screen.decode(errors="replace")
    assert proc.returncode == 0, text
    goal = re.search(r"goal ([0-9A-F]+/[0-9A-F]+)", out.decode())
    assert goal, out
    assert "catching up" in text and f"of {goal.group(1)}" in text and "rows/s" in text and "100%" in text, text
    assert "catching up: target at" not in text  # a bar, not lines
