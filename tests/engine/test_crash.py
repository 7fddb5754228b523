"""Exactly-once across crashes: the daemon is SIGKILLed again and again while the source is busy.

The daemon is the real thing (``applier run -c FILE``, the installed script, a
subprocess). A workload thread runs small source transactions, each of which
increments ``counter.n`` and inserts the log row whose id is the new value of n
(plus random upserts and deletes in ``kv``, and some rolled-back transactions);
the large-transaction variant also commits 5,000-row transactions so kills land
in the middle of applying one. A transaction applied twice would show as a
duplicate key in ``log`` or as ``counter.n`` differing from the number of log
rows; one lost, as a missing log row or a smaller n.

Each cycle starts the daemon, (usually) waits until it streams from the slot,
sleeps 0.2–1.5 s and SIGKILLs it; every other cycle first waits (up to 1 s more)
until the daemon is inside a target transaction, so kills surely land mid-apply.
Meanwhile a watcher checks, every 20 ms, that the slot is never confirmed past
the target's recorded position. After the cycles the workload stops, ``applier
catchup`` finishes the job, and the target must equal the source table by table.

The graceful test stops the daemon with SIGTERM: exit code 0, and the slot is
never confirmed past what the target recorded as applied.

The target-server test SIGKILLs the PostgreSQL *target* (postmaster and all) while
the daemon applies with synchronous_commit = off, so recent commits are really
lost: the slot must not have been confirmed past what survived (``durable_lsn``),
and the daemon must re-apply the lost transactions. The last test makes the
target refuse new connections for a while: the daemon must retry, not die.

Runs on the newest installed PostgreSQL only (the engine's version-specific
paths are covered by test_randomized on every version).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.admin import init, read_progress
from applier.lsn import LSN
from applier.sandbox.clusters import Cluster, find_install
from tests.engine import workload as wl
from tests.engine.conftest import NEWEST_PG, Target, make_cfg
from tests.plugins.cli import popen, run_cli, write_toml
from tests.plugins.clusters import ScratchDb

pytestmark = pytest.mark.parametrize("pg_install", [NEWEST_PG], indirect=True, ids=lambda v: f"pg{v}")

COUNTER = wl.Table("public", "counter", (wl.Col("id", "int4", "-", nullable=False),
                                         wl.Col("n", "int8", "-", nullable=False)), key=("id",))
LOG = wl.Table("public", "log", (wl.Col("id", "int8", "-", nullable=False), wl.Col("n_at", "int8", "-"),
                                 wl.Col("note", "text", "-"), wl.Col("at", "timestamptz", "-")), key=("id",))
KV = wl.Table("public", "kv", (wl.Col("k", "int4", "-", nullable=False), wl.Col("v", "text", "-"),
                               wl.Col("ver", "int8", "-")), key=("k",))
TABLES = (COUNTER, LOG, KV)
BIG_ROWS = 5000
KILLS = 20
BIG_EVERY = 2.5  # seconds between 5,000-row transactions in the large-transaction variant


def _seed() -> int:
    env = os.environ.get("APPLIER_TEST_SEED")
    return int(env) if env else random.randrange(2**32)


# -- set-up ------------------------------------------------------------------------------


def write_config(path: Path, source: ScratchDb, target: Target, work_dir: Path) -> Path:
    """The daemon's TOML config: fast retries, apply errors stop the daemon (so they cannot hide)."""
    sections = {
        "source": {"dsn": source.dsn, "slot": source.dbname, "publications": ["applier_pub"],
                   "status_interval": 1.0},
        "target": {"url": target.url},
        "apply": {"work_dir": str(work_dir), "retry_initial": 0.1, "retry_max": 1.0, "on_error": "stop"},
    }
    return write_toml(path, sections)


def setup(source: ScratchDb, target: Target, tmp_path: Path) -> tuple[Path, Any]:
    """Tables on both sides, counter row, publication, init; returns (config file, Config)."""
    source.cluster.execute(
        "\n".join(t.pg_ddl() for t in TABLES)
        + "INSERT INTO counter VALUES (1, 0);"
        + f"CREATE PUBLICATION applier_pub FOR TABLE {', '.join(t.pg for t in TABLES)};",
        source.dbname)
    target.execute_script("\n".join(t.pg_ddl() for t in TABLES), "\n".join(t.sqlite_ddl() for t in TABLES))
    cfg = make_cfg(source, target, tmp_path / "work")
    init(cfg)
    # The counter row exists before the slot does: put it on the target the way a snapshot copy would.
    target.execute_script("INSERT INTO counter VALUES (1, 0);", "INSERT INTO counter VALUES (1, 0);")
    return write_config(tmp_path / "applier.toml", source, target, tmp_path / "work"), cfg


# -- the workload ----------------------------------------------------------------------------


class Hammer(threading.Thread):
    """Small source transactions as fast as a little sleep allows; large ones every ``big_every`` s."""

    def __init__(self, dsn: str, seed: int, big_every: float | None = None) -> None:
        super().__init__(daemon=True, name="hammer")
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.big_every = big_every
        self.halt = threading.Event()
        self.committed = 0
        self.rolled_back = 0
        self.big = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                next_big = time.monotonic() + (self.big_every or 0)
                while not self.halt.is_set():
                    big = self.big_every is not None and time.monotonic() >= next_big
                    self.transaction(conn, big)
                    if big:
                        next_big = time.monotonic() + self.big_every  # type: ignore[operator]
                    time.sleep(self.rng.uniform(0.001, 0.006))
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def transaction(self, conn: psycopg.Connection[Any], big: bool) -> None:
        rng = self.rng
        conn.execute("BEGIN")
        step = BIG_ROWS if big else 1
        n = conn.execute("UPDATE counter SET n = n + %s WHERE id = 1 RETURNING n", [step]).fetchone()[0]
        conn.execute("INSERT INTO log SELECT g, %s, 'row ' || g || E'\\t' || %s, now() "
                     "FROM generate_series(%s::int8, %s::int8) g", [n, "x" * rng.randint(0, 200), n - step + 1, n])
        if rng.random() < 0.5:
            conn.execute("INSERT INTO kv VALUES (%s, %s, 1) ON CONFLICT (k) DO UPDATE "
                         "SET v = excluded.v, ver = kv.ver + 1", [rng.randrange(200), f"v{n}"])
        if rng.random() < 0.1:
            conn.execute("DELETE FROM kv WHERE k = %s", [rng.randrange(200)])
        if not big and rng.random() < 0.05:
            conn.execute("ROLLBACK")
            self.rolled_back += 1
            return
        conn.execute("COMMIT")
        self.committed += 1
        self.big += big

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        assert not self.is_alive(), "the workload thread did not stop"
        if self.error is not None:
            raise AssertionError(f"the workload failed: {self.error!r}") from self.error


class Watcher(threading.Thread):
    """Samples the slot's confirmed position, then the target's applied position, every 20 ms.

    Both only grow, so reading them in that order makes ``confirmed <= applied`` a sound check of
    every sample: the slot is never confirmed past what the target has committed.
    """

    def __init__(self, source: ScratchDb, target: Target, name: str) -> None:
        super().__init__(daemon=True, name="watcher")
        self.source, self.target, self.name = source, target, name
        self.halt = threading.Event()
        self.samples = 0
        self.violations: list[tuple[LSN, LSN]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.source.dsn, autocommit=True) as src:
                if self.target.db is not None:
                    tgt: Any = psycopg.connect(self.target.db.dsn, autocommit=True)
                else:
                    tgt = sqlite3.connect(self.target.path, isolation_level=None, timeout=30)  # type: ignore[arg-type]
                try:
                    while not self.halt.wait(0.02):
                        row = src.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                          "WHERE slot_name = %s", [self.source.dbname]).fetchone()
                        confirmed = LSN.parse(row[0])
                        got = tgt.execute(f"SELECT lsn FROM applier_progress WHERE name = '{self.name}'").fetchone()
                        applied = LSN.parse(got[0]) if got else LSN(0)
                        self.samples += 1
                        if applied > LSN(0) and confirmed > applied:
                            self.violations.append((confirmed, applied))
                finally:
                    tgt.close()
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        if self.error is not None:
            raise AssertionError(f"the watcher failed: {self.error!r}") from self.error


# -- the daemon ------------------------------------------------------------------------------


class Daemon:
    """``applier run -c FILE`` as a subprocess; output appended to one log file across restarts."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as out:
            out.write(b"---- start\n")
            out.flush()
            self.proc = popen(["run", "-c", str(self.config)], stdout=out, stderr=out, start_new_session=True)
        return self.proc

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def ensure_dead(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def slot_state(source: ScratchDb, slot: str) -> tuple[int | None, LSN]:
    """(active walsender pid or None, confirmed_flush_lsn) of the slot (read from the maintenance database: the
    cluster's kept connection, not a connection a look)."""
    pid, confirmed = source.cluster.execute(
        "SELECT active_pid, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        params=[slot])[0]
    return pid, LSN.parse(confirmed)


def wait_streaming(source: ScratchDb, daemon: Daemon, old_pid: int | None, timeout: float = 30) -> int:
    """Wait until a new walsender (not ``old_pid``) holds the slot; its pid."""
    deadline = time.monotonic() + timeout
    while True:
        assert daemon.proc is not None
        rc = daemon.proc.poll()
        assert rc is None, f"the daemon exited with {rc} before it was killed:\n{daemon.tail()}"
        pid, _ = slot_state(source, source.dbname)
        if pid is not None and pid != old_pid:
            return pid
        assert time.monotonic() < deadline, f"the daemon did not start streaming within {timeout}s:\n{daemon.tail()}"
        time.sleep(0.05)


def target_in_transaction(target: Target) -> bool:
    """True if the daemon has a transaction open on the target (SQLite: holds the write lock)."""
    if target.db is None:
        db = sqlite3.connect(target.path, timeout=0, isolation_level=None)  # type: ignore[arg-type]
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc), exc
            return True
        finally:
            db.close()
    return bool(target.db.cluster.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
        "AND backend_type = 'client backend' AND xact_start IS NOT NULL", params=[target.db.dbname])[0][0])


def catchup(config: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_cli("catchup", "-c", str(config), timeout=timeout)


def check_result(source: ScratchDb, target: Target, where: str) -> int:
    """Target equals source table by table; counter = log rows on both; returns n."""
    problems = wl.compare(source.dsn, target.kind, target.ref, TABLES)
    assert not problems, f"{where}:\n" + "\n".join(problems)
    src_n, src_rows = source.cluster.execute("SELECT (SELECT n FROM counter), (SELECT count(*) FROM log)",
                                             source.dbname)[0]
    tgt_n = target.query("SELECT n FROM counter WHERE id = 1")[0][0]
    tgt_rows = target.query("SELECT count(*) FROM log")[0][0]
    assert src_n == src_rows == tgt_n == tgt_rows, (
        f"{where}: source counter {src_n}, source log rows {src_rows}, target counter {tgt_n}, target log rows {tgt_rows}")
    return src_n


def no_engine_complaints(log_text: str, where: str) -> None:
    """Nothing was missing, duplicated or failing while the daemon ran."""
    bad = [line for line in log_text.splitlines()
           if "not found" in line or "apply failed" in line or "duplicate key" in line or " ERROR " in line]
    assert not bad, f"{where}: the daemon logged problems:\n" + "\n".join(bad[:10])


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_sigkill_loop_applies_every_transaction_exactly_once(source_db: ScratchDb, target: Target, tmp_path: Path,
                                                             big: bool) -> None:
    seed = _seed()
    print(f"seed {seed} (rerun with APPLIER_TEST_SEED={seed})")
    where = f"[seed {seed}, pg{source_db.cluster.install.version}, target {target.kind}, {'big' if big else 'small'}]"
    rng = random.Random(seed)
    config, cfg = setup(source_db, target, tmp_path)
    daemon = Daemon(config, tmp_path / "daemon.log")
    hammer = Hammer(source_db.dsn, rng.randrange(2**32), big_every=BIG_EVERY if big else None)
    hammer.start()
    watcher = Watcher(source_db, target, cfg.apply["name"])
    watcher.start()
    advanced = 0
    mid_txn = 0  # kills that found the daemon inside a target transaction
    last_pid: int | None = None
    last_progress = read_progress(cfg).lsn
    try:
        for i in range(KILLS):
            t0 = time.monotonic()
            daemon.start()
            # Most kills land while applying; every fourth may land anywhere from start-up on.
            if i % 4 != 3:
                last_pid = wait_streaming(source_db, daemon, last_pid)
            t1 = time.monotonic()
            time.sleep(rng.uniform(0.2, 1.5))
            rc = daemon.proc.poll()  # type: ignore[union-attr]
            assert rc is None, f"{where} cycle {i}: the daemon exited with {rc} on its own:\n{daemon.tail()}"
            inside = target_in_transaction(target)
            deadline = time.monotonic() + 1.0
            while i % 2 == 0 and not inside and time.monotonic() < deadline:
                # every other cycle: go on until the daemon is inside a target transaction (mid-apply)
                time.sleep(0.005)
                inside = target_in_transaction(target)
            mid_txn += inside
            daemon.signal(signal.SIGKILL)
            daemon.wait(10)
            progress = read_progress(cfg).lsn
            _, confirmed = slot_state(source_db, source_db.dbname)
            assert confirmed <= progress or progress == LSN(0), (
                f"{where} cycle {i}: slot confirmed {confirmed} past the target's applied {progress}")
            advanced += progress > last_progress
            print(f"cycle {i}: streaming after {t1 - t0:.2f}s, applied {last_progress} -> {progress}")
            last_progress = progress
    finally:
        daemon.ensure_dead()
        watcher.stop()
        hammer.stop()
    assert not watcher.violations, (
        f"{where}: the slot was confirmed past the target's applied position in {len(watcher.violations)} of "
        f"{watcher.samples} samples, e.g. (confirmed, applied) = {watcher.violations[:3]}")
    print(f"{where} {watcher.samples} position samples; {hammer.committed} committed ({hammer.big} big), "
          f"{hammer.rolled_back} rolled back; "
          f"progress advanced in {advanced} of {KILLS} cycles; {mid_txn} kills inside a target transaction")
    # The kills hit a daemon that was applying (not one that was idle or still starting).
    assert advanced >= KILLS // 4, f"{where}: the daemon made progress in only {advanced} of {KILLS} cycles"
    assert mid_txn >= 3, f"{where}: only {mid_txn} kills landed inside a target transaction"
    assert not big or hammer.big >= 5, f"{where}: only {hammer.big} large transactions"
    t0 = time.monotonic()
    result = catchup(config)
    print(f"catchup {time.monotonic() - t0:.2f}s: {result.stdout.strip()}")
    assert result.returncode == 0, f"{where}: catchup failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    n = check_result(source_db, target, where)
    assert n >= hammer.committed, where
    no_engine_complaints(daemon.text() + result.stderr, where)


@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_sigterm_stops_cleanly_and_never_confirms_past_the_target(source_db: ScratchDb, target: Target,
                                                                  tmp_path: Path) -> None:
    seed = _seed()
    where = f"[seed {seed}, pg{source_db.cluster.install.version}, target {target.kind}]"
    config, cfg = setup(source_db, target, tmp_path)
    daemon = Daemon(config, tmp_path / "daemon.log")
    hammer = Hammer(source_db.dsn, seed, big_every=BIG_EVERY)
    hammer.start()
    try:
        for cycle in range(2):
            daemon.start()
            wait_streaming(source_db, daemon, None)
            time.sleep(2.0 + random.Random(seed + cycle).uniform(0, 1))
            daemon.signal(signal.SIGTERM)
            rc = daemon.wait(30)
            assert rc == 0, f"{where} cycle {cycle}: SIGTERM gave exit code {rc}:\n{daemon.tail()}"
            assert "applied " in daemon.tail(5), f"{where}: no summary line:\n{daemon.tail()}"
            progress = read_progress(cfg).lsn
            deadline = time.monotonic() + 10
            while (state := slot_state(source_db, source_db.dbname))[0] is not None:
                assert time.monotonic() < deadline, f"{where}: the slot stays active after the daemon exited"
                time.sleep(0.05)
            confirmed = state[1]
            print(f"{where} cycle {cycle}: applied {progress}, slot confirmed {confirmed}")
            assert progress > LSN(0), f"{where}: nothing was applied"
            assert confirmed <= progress, f"{where}: slot confirmed {confirmed} past the target's applied {progress}"
    finally:
        daemon.ensure_dead()
        hammer.stop()
    result = catchup(config)
    assert result.returncode == 0, f"{where}: catchup failed:\n{result.stdout}\n{result.stderr}"
    check_result(source_db, target, where)
    no_engine_complaints(daemon.text() + result.stderr, where)


def test_target_server_crash_loses_nothing(source_db: ScratchDb, tmp_path: Path) -> None:
    """The target server itself is SIGKILLed (postmaster and children) while the daemon applies with
    synchronous_commit = off, so commits still in its WAL buffers are lost. The slot must never have
    been confirmed past what survives, and the daemon (which keeps running, retrying the target)
    must re-apply exactly what was lost. Uses its own target cluster, not the shared one."""
    seed = _seed()
    where = f"[seed {seed}, pg{source_db.cluster.install.version}, target server crash]"
    rng = random.Random(seed)
    cluster = Cluster(find_install(NEWEST_PG), name="crash-target")
    daemon: Daemon | None = None
    hammer: Hammer | None = None
    try:
        cluster.start()
        cluster.create_database("tgt")
        db = ScratchDb(cluster, "tgt", cluster.dsn("tgt"))
        target = Target("pg", db.url, db=db)
        config, cfg = setup(source_db, target, tmp_path)
        daemon = Daemon(config, tmp_path / "daemon.log")
        hammer = Hammer(source_db.dsn, rng.randrange(2**32), big_every=BIG_EVERY)
        hammer.start()
        daemon.start()
        lost = 0
        for i in range(5):
            wait_streaming(source_db, daemon, None, timeout=60)
            time.sleep(rng.uniform(0.5, 2.0))
            before = read_progress(cfg).lsn
            cluster.kill()
            cluster.start()
            _, confirmed = slot_state(source_db, source_db.dbname)  # the slot first: both only grow
            after = read_progress(cfg).lsn
            lost += after < before
            print(f"{where} crash {i}: applied {before} before, {after} after recovery; slot confirmed {confirmed}")
            assert confirmed <= after, (
                f"{where} crash {i}: slot confirmed {confirmed} but the recovered target has only {after}")
            assert daemon.proc.poll() is None, f"{where}: the daemon gave up:\n{daemon.tail()}"  # type: ignore[union-attr]
        hammer.stop()
        wait_streaming(source_db, daemon, None, timeout=60)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, f"{where}: SIGTERM after the crashes:\n{daemon.tail()}"
        print(f"{where} {hammer.committed} committed; recovered target behind its pre-crash position {lost} times")
        result = catchup(config)
        assert result.returncode == 0, f"{where}: catchup failed:\n{result.stdout}\n{result.stderr}"
        check_result(source_db, target, where)
        no_engine_complaints(daemon.text() + result.stderr, where)
    finally:
        if daemon is not None:
            daemon.ensure_dead()
        if hammer is not None and hammer.is_alive():
            hammer.stop()
        cluster.stop()


@pytest.mark.parametrize("target", ["pg"], indirect=True)
def test_target_refusing_new_connections_is_retried_not_fatal(source_db: ScratchDb, target: Target,
                                                             tmp_path: Path) -> None:
    """While the daemon streams, the target database stops accepting connections (its existing ones
    stay), and a change arrives for a table the daemon has not bound yet: binding needs a connection.
    A target that is briefly unavailable is a connection problem: the daemon retries and applies the
    change once the target accepts connections again; it must not die."""
    assert target.db is not None
    config, cfg = setup(source_db, target, tmp_path)
    daemon = Daemon(config, tmp_path / "daemon.log")
    allow = "ALTER DATABASE {} ALLOW_CONNECTIONS {}"
    name = f'"{target.db.dbname}"'
    try:
        daemon.start()
        wait_streaming(source_db, daemon, None)
        target.db.cluster.execute(allow.format(name, "false"))
        source_db.cluster.execute("UPDATE counter SET n = n + 1; INSERT INTO log VALUES (1, 1, 'x', now())",
                                  source_db.dbname)
        time.sleep(3)
        rc = daemon.proc.poll()  # type: ignore[union-attr]
        assert rc is None, f"the daemon died (exit {rc}) while the target refused connections:\n{daemon.tail(15)}"
        target.db.cluster.execute(allow.format(name, "true"))
        deadline = time.monotonic() + 30
        while target.query("SELECT count(*) FROM log")[0][0] == 0:
            assert time.monotonic() < deadline, f"the change never arrived:\n{daemon.tail()}"
            time.sleep(0.1)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.tail()
    finally:
        target.db.cluster.execute(allow.format(name, "true"))
        daemon.ensure_dead()
    check_result(source_db, target, "[target refusing connections]")
