"""A table added to a running replica (``applier sync --table``): equal to the source, each row once.

What a user relies on: after the full sync, a table added to the publication
(with rows, while writers keep inserting and updating it and other tables) is
copied by ``applier sync --table`` at a snapshot and joined to the stream, and
ends equal to the source, whether ``applier run`` was stopped (then
``catchup``), kept running, or was SIGKILLed in the middle of the copy and
started again. Changes to the table committed before the copy's snapshot are
in the copy: applied again, an insert would collide on the primary key (the
daemon stops: ``apply.on_error = stop``) and the table would not end equal.
Refusals are one line each: no completed sync, a two-phase config, a table
that is not published or does not exist.

How each test fails without the engine's gate (checked by disabling
``JoinGate.place``): (a)-(c) the stream's changes before the snapshot are
applied on top of the copy (duplicate key: catchup fails, the daemon stops),
and the daemon does not wait for the table (missing table errors).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.config import load_config
from applier.migrate.add_table import sync_tables
from applier.migrate.sync import sync
from applier.sandbox.clusters import find_install
from applier.targets.claim import copy_claim_name
from applier.targets.postgres.claim import pg_claim
from applier.targets.postgres.target import libpq_dsn
from tests.plugins.cli import invoke, popen, run_cli, write_toml
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db
from tests.spark.conftest import make_config, target_exec

pytest.importorskip("pyspark")

ROWS = 30000
SOURCE = f"""
CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL);
INSERT INTO a SELECT g, 0 FROM generate_series(1, 1000) g;
CREATE TABLE n (id int PRIMARY KEY, v int NOT NULL, note text);
INSERT INTO n SELECT g, 0, 'seed ' || g FROM generate_series(1, {ROWS}) g;
CREATE PUBLICATION pub FOR TABLE a;
"""
SELECT_N = "SELECT id, v, note FROM n ORDER BY id"
SELECT_A = "SELECT id, v FROM a ORDER BY id"


class Writer(threading.Thread):
    """Small source transactions until stopped: a new row of n, an update of n and of a, now and then a delete."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True, name="writer")
        self.dsn = dsn
        self.rng = random.Random(os.getpid())
        self.halt = threading.Event()
        self.next_id = ROWS + 1
        self.committed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.halt.is_set():
                    self.transaction(conn)
                    time.sleep(0.003)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def transaction(self, conn: psycopg.Connection[Any]) -> None:
        rng = self.rng
        with conn.transaction():
            conn.execute("INSERT INTO n VALUES (%s, 0, %s)", [self.next_id, f"new {self.next_id}"])
            conn.execute("UPDATE n SET v = v + 1, note = note || '+' WHERE id = %s", [rng.randint(1, self.next_id)])
            conn.execute("UPDATE a SET v = v + 1 WHERE id = %s", [rng.randint(1, 1000)])
            if rng.random() < 0.05:
                conn.execute("DELETE FROM n WHERE id = %s", [rng.randint(1, self.next_id)])
        self.next_id += 1
        self.committed += 1

    def pause(self, seconds: float) -> None:
        """Let it commit for a while (at least a few transactions)."""
        start = self.committed
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or self.committed < start + 5:
            assert self.error is None, self.error
            time.sleep(0.05)

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        assert not self.is_alive(), "the writer did not stop"
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error


def config_file(path: Path, src: ScratchDb, target_url: str, work: Path, **extra: Any) -> Path:
    """The TOML config a user would write: apply errors stop the daemon (so none can hide)."""
    return write_toml(path, {
        "source": {"dsn": src.dsn, "slot": "applier", "publications": ["pub"], "status_interval": 1.0,
                   **extra.get("source", {})},
        "target": {"url": target_url},
        "apply": {"work_dir": str(work), "retry_initial": 0.1, "retry_max": 1.0, "on_error": "stop",
                  "group_commit_delay": 0.05},
        "spark": {"master": "local[2]", "partitions": 2, **extra.get("spark", {})},
    })


def cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``applier ARGS`` as a user would (``env``: added to the environment)."""
    return run_cli(*args, env=env, timeout=timeout)


def start_daemon(cfg_file: Path, log: Path) -> subprocess.Popen[bytes]:
    """``applier run`` in the background, its output appended to ``log``."""
    with log.open("ab") as out:
        return popen(["run", "-c", str(cfg_file)], stdout=out, stderr=subprocess.STDOUT)


def synced(spark: Any, cfg_file: Path) -> None:
    """The target copied from the source by the full sync, in this process on the shared Spark session (the
    command's own start is tested in test_migration and test_failures; here only its result matters)."""
    sync(load_config(cfg_file, env={}), spark=spark)


def synced_and_running(spark: Any, src: ScratchDb, cfg_file: Path, log: Path) -> subprocess.Popen[bytes]:
    """SOURCE on the source, copied to the target by the full sync, and `applier run` started on it."""
    src.cluster.execute(SOURCE, src.dbname)
    synced(spark, cfg_file)
    return start_daemon(cfg_file, log)


class Adder(threading.Thread):
    """`applier sync --table` of ``names`` in this process on the shared Spark session, in the background (where
    the command's own process is not the point); ``join_result()`` waits and returns its result."""

    def __init__(self, spark: Any, cfg_file: Path, *names: str) -> None:
        super().__init__(daemon=True)
        self.args = (spark, load_config(cfg_file, env={}), list(names))
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        spark, cfg, names = self.args
        try:
            self.result = sync_tables(cfg, names, spark=spark)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            self.error = exc

    def join_result(self, seconds: float = 300) -> Any:
        self.join(seconds)
        assert not self.is_alive(), "`sync --table` did not end"
        if self.error is not None:
            raise AssertionError(f"`sync --table` failed: {self.error}") from self.error
        return self.result


def equal_soon(src: ScratchDb, target_url: str, seconds: float = 90) -> None:
    """Wait until the target's n and a equal the source's (the writer stopped); assert it."""
    want_n, want_a = src.cluster.execute(SELECT_N, src.dbname), src.cluster.execute(SELECT_A, src.dbname)
    deadline = time.monotonic() + seconds
    while True:
        try:
            got_n, got_a = target_exec(target_url, SELECT_N), target_exec(target_url, SELECT_A)
        except Exception:  # noqa: BLE001 - the table may not exist yet, SQLite may be busy
            got_n, got_a = [], []
        if (got_n, got_a) == (want_n, want_a) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(got_n) == len(want_n) and got_a == want_a
    assert got_n == want_n


def stop_once(equal: Callable[[], None], daemon: subprocess.Popen[Any], log: Path) -> str:
    """``equal()`` (it waits until the target equals the source), then SIGTERM the daemon, which must exit 0; its
    log."""
    try:
        equal()
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
    text = log.read_text()
    assert code == 0, text
    return text


def equal_then_stop(src: ScratchDb, target_url: str, daemon: subprocess.Popen[bytes], log: Path) -> str:
    """Wait until the target equals the source, then SIGTERM the daemon, which must exit 0; its log."""
    return stop_once(lambda: equal_soon(src, target_url), daemon, log)


def sync_state(target_url: str, table: str = "n") -> str | None:
    try:
        rows = target_exec(target_url, f"SELECT state FROM applier_sync_tables WHERE table_name = '{table}'")
    except Exception:  # noqa: BLE001 - SQLite may be busy
        return None
    return rows[0][0] if rows else None


def test_added_while_stopped_then_catchup(spark: Any, src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = make_config(src, target_url, tmp_path / "work")
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
    sync(cfg, spark=spark)
    writer = Writer(src.dsn)
    writer.start()
    try:
        writer.pause(0.5)
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        writer.pause(1.0)  # changes to n in the stream, before the copy's snapshot: in the copy too
        said: list[str] = []
        res = sync_tables(cfg, ["public.n"], spark=spark, say=said.append)
        assert [t.table for t in res.tables] == ["public.n"] and res.tables[0].rows > ROWS
        assert any(s.startswith("created target table") for s in said), said
        writer.pause(1.0)  # and after it
    finally:
        writer.stop()
    assert target_exec(target_url, "SELECT state, snapshot_lsn FROM applier_sync_tables") == [
        ("ready", str(res.consistent_point))]
    done = cli("catchup", "-c", str(cfg_file))
    assert done.returncode == 0, done.stderr
    equal_soon(src, target_url, seconds=0)


@pytest.mark.parametrize(("version", "target_kind"), [(18, "postgresql"), (18, "sqlite"), (15, "postgresql")],
                         ids=["pg18-postgresql", "pg18-sqlite", "pg15-postgresql"])
def test_added_under_a_running_daemon(spark: Any, version: int, target_kind: str, pg_clusters: ClusterPool,
                                      newest_target: Any, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(scratch_db(pg_clusters.get(find_install(version), "source"), "src"))
        target_url = (f"sqlite:///{tmp_path / 'replica.db'}" if target_kind == "sqlite"
                      else stack.enter_context(scratch_db(newest_target, "tgt")).url)
        _added_under_a_running_daemon(spark, source, target_url, tmp_path, kill=False)


def test_daemon_killed_during_the_copy(spark: Any, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    _added_under_a_running_daemon(spark, src, dst.url, tmp_path, kill=True)


def _added_under_a_running_daemon(spark: Any, src: ScratchDb, target_url: str, tmp_path: Path, kill: bool) -> None:
    """`sync --table` of n under `applier run`: the command itself when ``kill`` (the daemon SIGKILLed during
    its copy), else in this process."""
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
    log = tmp_path / "daemon.log"
    daemon = synced_and_running(spark, src, cfg_file, log)
    writer = Writer(src.dsn)
    writer.start()
    adder: subprocess.Popen[str] | None = None
    try:
        writer.pause(1.0)
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        wait_for("the daemon to meet n's changes (no target table yet: it waits)",
                 lambda: "waiting for `applier sync --table public.n`" in log.read_text(), seconds=300)
        if not kill:
            res = Adder(spark, cfg_file, "public.n")
            res.start()
            assert [t.table for t in res.join_result().tables] == ["public.n"]
        else:  # SIGKILL the daemon while the command copies, and start it again
            adder = popen(["sync", "-c", str(cfg_file), "--table", "public.n", "-q"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
            wait_for("the copy", lambda: sync_state(target_url) == "copying" or adder.poll() is not None)
            assert sync_state(target_url) == "copying", "the copy was over before the daemon could be killed"
            daemon.send_signal(signal.SIGKILL)
            daemon.wait(30)
            daemon = start_daemon(cfg_file, log)
            out, err = adder.communicate(timeout=300)
            assert adder.returncode == 0, err
            assert "joined to the stream at" in out
        writer.pause(2.0)
    finally:
        writer.stop()
        if adder is not None and adder.poll() is None:
            adder.kill()
    text = equal_then_stop(src, target_url, daemon, log)
    assert "source table public.n is published but target table" in text, text
    assert "waiting for `applier sync --table public.n`" in text
    assert "apply failed" not in text and "ERROR" not in text, text


def test_refusals(spark: Any, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE + "CREATE TABLE lone (id int PRIMARY KEY);"
                        "CREATE TABLE parent (id int, k int, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);"
                        "CREATE TABLE part1 PARTITION OF parent FOR VALUES FROM (0) TO (10);"
                        "INSERT INTO parent VALUES (1, 1);", src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    assert invoke("init", "-c", str(cfg_file)).returncode == 0

    # the refusals run the command in this process (the same code to the one line and the exit code, without a
    # Python start each); the first one, and the failed copy at the end, as the installed script
    def refused(*args: str, cfg: Path = cfg_file, run: Any = invoke) -> str:
        res = run("sync", "-c", str(cfg), *args)
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
        return str(res.stderr).strip()

    src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n, parent", src.dbname)  # parent: through part1
    synced(spark, cfg_file)
    line = refused("--table", "public.lone", run=cli)
    assert line.startswith("applier: error: ") and "\n" not in line, line  # one line, nothing else
    assert "source table public.lone is not published by pub" in line and "ALTER PUBLICATION" in line, line
    assert "source table public.nosuch does not exist" in refused("--table", "nosuch")
    line = refused("--table", "public.n")  # copied by the full sync: the daemon applies its changes
    assert "target table public.n exists, but not from `applier sync --table public.n`" in line, line
    two_phase = config_file(tmp_path / "2pc.toml", src, dst.url, tmp_path / "work", source={"two_phase": True})
    assert "cannot join a table to a two-phase stream" in refused("--table", "public.lone", cfg=two_phase)
    line = refused("--table", "public.parent")  # in the publication already: naming its partitions helps
    assert "source table public.parent is partitioned and published through its partitions public.part1" in line
    assert target_exec(dst.url, "SELECT count(*) FROM applier_sync_tables") == [(0,)]

    with psycopg.connect(libpq_dsn(dst.url), autocommit=True) as other:
        pg_claim(other, "applier", "run")  # as `applier run` does
        line = refused("--table", "public.n", "--force")
        assert "--force empties target table public.n, but an applier applies to this target" in line, line
        assert "applier run (pid" in line, line
    with psycopg.connect(libpq_dsn(dst.url), autocommit=True) as other:  # another `sync --table` of n runs
        pg_claim(other, copy_claim_name("applier", "public", "n"), "sync --table")
        line = refused("--table", "public.n", "--force")
        assert "another `applier sync --table` is copying source table public.n" in line, line
        assert "applier sync --table (pid" in line, line
    assert target_exec(dst.url, "SELECT count(*) FROM applier_sync_tables") == [(0,)]
    assert target_exec(dst.url, "SELECT count(*) FROM n") == [(ROWS,)]  # neither emptied it

    target_exec(dst.url, "CREATE TABLE ref (id int REFERENCES n (id)); INSERT INTO ref VALUES (1)")
    line = refused("--table", "public.n", "--force")
    assert "references it (foreign key ref_id_fkey) and holds rows" in line, line
    assert "then run `applier sync --table public.n` again" in line, line
    target_exec(dst.url, "DROP TABLE ref")
    with psycopg.connect(libpq_dsn(dst.url)) as other:  # a lock the copy cannot get (lock_timeout): one line
        other.execute("LOCK TABLE n IN ACCESS EXCLUSIVE MODE")
        res = cli("sync", "-c", str(cfg_file), "--table", "public.n", env={"PGOPTIONS": "-c lock_timeout=300"})
        other.rollback()
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert "`applier sync --table` failed: " in res.stderr and "lock timeout" in res.stderr, res.stderr


def wait_for(what: str, check: Any, seconds: float = 120) -> None:
    """Poll ``check()`` until it is true; assert it was (``what``: said if not)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("target_kind", ["postgresql", "sqlite"])
def test_copy_killed_and_run_again(spark: Any, target_kind: str, src: ScratchDb, dst: ScratchDb,
                                   tmp_path: Path) -> None:
    """`sync --table` SIGKILLed in the middle of its copy (some partitions written) while `applier run` runs:
    the daemon says the copy is dead, `catchup` fails with that line, and `sync --table` run again empties the
    table and copies it at a new snapshot: equal to the source, each row once, no partitions left over."""
    big = "INSERT INTO n SELECT g, 0, repeat('x', 300) FROM generate_series(-150000, -1) g;"
    src.cluster.execute(SOURCE + big, src.dbname)
    target_url = f"sqlite:///{tmp_path / 'replica.db'}" if target_kind == "sqlite" else dst.url
    cfg_file = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
    synced(spark, cfg_file)
    log = tmp_path / "daemon.log"
    daemon = start_daemon(cfg_file, log)
    writer = Writer(src.dsn)
    writer.start()
    adder: subprocess.Popen[str] | None = None
    try:
        writer.pause(1.0)
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        writer.pause(1.0)
        adder = popen(["sync", "-c", str(cfg_file), "--table", "public.n", "--partitions", "8", "-q"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

        def some_parts() -> bool:
            try:
                return bool(target_exec(target_url, "SELECT 1 FROM applier_sync_parts WHERE tbl = 'public.n'"))
            except Exception:  # noqa: BLE001 - SQLite may be busy
                return False

        wait_for("a partition of n copied", lambda: some_parts() or adder.poll() is not None)
        assert adder.poll() is None, "the copy was over before it could be killed"
        os.killpg(adder.pid, signal.SIGKILL)  # the command and its Spark JVM, as a service manager would
        adder.wait(30)
        assert sync_state(target_url) == "copying"
        wait_for("the daemon to see the dead copy", lambda: "is not running" in log.read_text(), seconds=60)
        writer.pause(1.0)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, log.read_text()
        stuck = cli("catchup", "-c", str(cfg_file))  # ends, with the line, instead of waiting for nobody
        assert stuck.returncode != 0 and "Traceback" not in stuck.stderr, stuck.stderr
        assert "the copy of table public.n at " in stuck.stderr, stuck.stderr
        assert "is not running (no `applier sync --table` holds it" in stuck.stderr, stuck.stderr
        daemon = start_daemon(cfg_file, log)
        said: list[str] = []  # run again in this process: the killed one was the command
        sync_tables(load_config(cfg_file, env={}), ["public.n"], spark=spark, say=said.append, partitions=8)
        assert any("restarting the interrupted copy of public.n (copying" in line for line in said), said
        writer.pause(2.0)
    finally:
        writer.stop()
        if adder is not None and adder.poll() is None:
            adder.kill()
    text = equal_then_stop(src, target_url, daemon, log)
    assert "the copy of table public.n at " in text and "run `applier sync --table public.n` again" in text, text
    assert "apply failed" not in text and "ERROR" not in text, text
    assert target_exec(target_url, "SELECT count(*) FROM applier_sync_parts") == [(0,)]  # the killed run's too
    assert target_exec(target_url, "SELECT state FROM applier_sync_tables") == [("ready",)]


def test_refused_while_the_running_stream_lacks_the_publication(spark: Any, src: ScratchDb, dst: ScratchDb,
                                                                 tmp_path: Path) -> None:
    """`applier run` streams with the publications it started with: `sync --table` of a table published only by a
    publication added to the config since is refused (the daemon would pass the copy without its changes)."""
    src.cluster.execute(SOURCE, src.dbname)
    cfg_file = config_file(tmp_path / "applier.toml", src, dst.url, tmp_path / "work")
    synced(spark, cfg_file)
    daemon = start_daemon(cfg_file, tmp_path / "daemon.log")
    try:
        wait_for("the daemon to stream", lambda: src.cluster.execute(
            "SELECT active FROM pg_replication_slots WHERE slot_name = 'applier'", src.dbname) == [(True,)])
        src.cluster.execute("CREATE PUBLICATION pub2 FOR TABLE n", src.dbname)
        both = config_file(tmp_path / "both.toml", src, dst.url, tmp_path / "work",
                           source={"publications": ["pub", "pub2"]})
        res = cli("sync", "-c", str(both), "--table", "public.n")
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
        assert "streams publications pub, which do not publish public.n (pub2)" in res.stderr, res.stderr
        assert "Restart `applier run`" in res.stderr
        assert target_exec(dst.url, "SELECT count(*) FROM applier_sync_tables") == [(0,)]
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0


# The hold is seen only if the daemon reads the COMMIT PREPARED while the copy still runs (a few seconds of Spark): on
# a loaded machine the copy can end first (once in a CI run: the transaction then applied as after any copy, the
# target equal, no message), so the test may run again; the outcome is checked in full every time.
@pytest.mark.flaky(reruns=1)
def test_prepared_transaction_committed_during_the_copy(spark: Any, src: ScratchDb, tmp_path: Path) -> None:
    """A two-phase stream into SQLite keeps a prepared transaction until COMMIT PREPARED and applies it then, at
    its commit LSN. Committed while `sync --table` copies the table it changes (after the copy's snapshot), its
    replay waits for the copy like any change (rolled back, no failure), and it lands once: the daemon does not
    stop (``apply.on_error = stop``). (`sync --table` itself runs with a config without two_phase.)"""
    big = "INSERT INTO n SELECT g, 0, repeat('x', 300) FROM generate_series(-150000, -1) g;"
    src.cluster.execute(SOURCE + big, src.dbname)
    target_url = f"sqlite:///{tmp_path / 'replica.db'}"
    two_phase = config_file(tmp_path / "2pc.toml", src, target_url, tmp_path / "work", source={"two_phase": True})
    plain = config_file(tmp_path / "applier.toml", src, target_url, tmp_path / "work")
    synced(spark, two_phase)
    log = tmp_path / "daemon.log"
    daemon = start_daemon(two_phase, log)
    adder = Adder(spark, plain, "public.n")
    try:
        src.cluster.execute("ALTER PUBLICATION pub ADD TABLE n", src.dbname)
        adder.start()
        wait_for("the copy", lambda: sync_state(target_url) == "copying" or not adder.is_alive())
        src.cluster.execute("BEGIN; INSERT INTO n VALUES (-200000, 7, 'prepared'); UPDATE a SET v = 7 WHERE id = 1;"
                            "PREPARE TRANSACTION 'p1'", src.dbname)
        src.cluster.execute("COMMIT PREPARED 'p1'", src.dbname)
        assert sync_state(target_url) == "copying", "the copy was over before the prepared transaction committed"
        adder.join_result()
        equal_soon(src, target_url)
        assert daemon.poll() is None, log.read_text()
    finally:
        adder.join(300)
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        for (gid,) in src.cluster.execute("SELECT gid FROM pg_prepared_xacts", src.dbname):
            src.cluster.execute(f"ROLLBACK PREPARED '{gid}'", src.dbname)
    text = log.read_text()
    assert code == 0, text
    assert "table public.n is being copied at its snapshot" in text, text  # the replay held its change
    assert "apply failed" not in text and "ERROR" not in text, text
