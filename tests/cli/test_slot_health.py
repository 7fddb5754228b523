"""How near the slot is to invalidation: ``applier status``, ``applier check``, the daemon's warning and metrics.

Real servers of their own (PostgreSQL 15 and 18, each started for the test with a small ``max_slot_wal_keep_size``:
the settings are the server's, not to be changed on the shared clusters), a SQLite target, the installed
``applier`` script run as an operator runs it. A stopped replica's slot holds WAL back while the source writes:
status shows the WAL held against the limit, check warns near it and past it (wal_status 'unreserved'), and once
a checkpoint invalidates the slot the appliers stop with the one line they always did (exit 6). A running daemon
whose slot an open source transaction holds back logs one WARNING when it crosses into 'unreserved', and serves
the figures over HTTP. On PostgreSQL 18, an idle slot against ``idle_replication_slot_timeout``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.sandbox.clusters import Cluster, PgInstall, find_install, find_installs
from tests.cli.opsrig import SLOT, Rig
from tests.engine.features.test_observability import free_port, scrape, value
from tests.plugins.clusters import ScratchDb, scratch_db

KEEP = 1024 * 1024  # max_slot_wal_keep_size = 1MB, in bytes


def _installs() -> list[int]:
    return [i.version for i in find_installs()]


@pytest.fixture(params=_installs(), ids=lambda v: f"pg{v}")
def install(request: pytest.FixtureRequest) -> PgInstall:
    return find_install(request.param)


@contextlib.contextmanager
def _own(install: PgInstall, name: str, **settings: str) -> Iterator[ScratchDb]:
    """A database on a server started for this test with ``settings``, stopped afterwards."""
    cluster = Cluster(install, name=name, settings=settings).start()
    try:
        with scratch_db(cluster, "sh") as db:
            yield db
    finally:
        cluster.stop("immediate")


@pytest.fixture
def kept(install: PgInstall) -> Iterator[ScratchDb]:
    """A database on a server with max_slot_wal_keep_size = 1MB."""
    with _own(install, f"sh-keep-{install.version}", max_slot_wal_keep_size="1MB") as db:
        yield db


def _status(rig: Rig) -> dict[str, Any]:
    r = rig.applier("status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _slot_line(rig: Rig) -> str:
    """``applier check``'s slot state line (check passes: a warning is no failure)."""
    r = rig.applier("check")
    line = next(x for x in r.stdout.splitlines() if " slot state:" in x)
    assert (r.returncode != 0) == line.startswith("fail"), r.stdout + r.stderr
    return line


def _wait_for(what: str, cond: Callable[[], Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_stopped_replica_s_slot_near_and_past_max_slot_wal_keep_size(kept: ScratchDb, install: PgInstall,
                                                                        tmp_path: Path) -> None:
    kept.cluster.execute("SELECT pg_switch_wal()")  # the slot starts near the start of a WAL segment
    rig = Rig.make(kept, None, tmp_path)
    rig.prepare("init")
    rig.src("INSERT INTO t VALUES (1, 'a')")
    rig.prepare("catchup")

    info = _status(rig)
    assert info["slot_wal_status"] == "reserved" and info["max_slot_wal_keep_size"] == KEEP, info
    assert info["slot_safe_wal_size"] > 0 and 0 <= info["slot_retained_bytes"] < 0.5 * KEEP, info
    assert info["slot_warnings"] == [], info
    if install.version >= 18:  # off by default, said so; the stopped replica's slot is idle
        assert info["idle_replication_slot_timeout"] == 0 and info["slot_idle_seconds"] >= 0, info
    else:
        assert info["idle_replication_slot_timeout"] is None, info
    line = _slot_line(rig)
    assert line.startswith("ok") and "wal_status reserved" in line and "max_slot_wal_keep_size 1.0 MB" in line, line

    # the replica stopped, the source writes: the slot holds the WAL back, near the limit (same segment: reserved)
    n = 1
    held = "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = %s"
    while rig.src(held, [SLOT])[0][0] < 0.85 * KEEP:
        rig.src("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(%s::int, %s::int) g", [n + 1, n + 500])
        n += 500
    info = _status(rig)
    assert info["slot_wal_status"] == "reserved" and 0.85 * KEEP <= info["slot_retained_bytes"] < KEEP, info
    assert len(info["slot_warnings"]) == 1 and "of max_slot_wal_keep_size 1.0 MB" in info["slot_warnings"][0], info
    line = _slot_line(rig)
    assert line.startswith("warn") and f"slot '{SLOT}' holds " in line and "of max_slot_wal_keep_size 1.0 MB" in line
    text = rig.applier("status").stdout
    assert f"max_slot_wal_keep_size: {KEEP}\n" in text and f"slot_warning: slot '{SLOT}' holds " in text, text

    # past it: the next segment, and the slot's WAL is no longer reserved (a checkpoint would remove it)
    rig.src("SELECT pg_switch_wal()")
    rig.src("INSERT INTO t VALUES (0, 'past')")
    info = _status(rig)
    assert info["slot_wal_status"] == "unreserved" and info["slot_retained_bytes"] > KEEP, info
    line = _slot_line(rig)
    assert line.startswith("warn") and f"slot '{SLOT}' has wal_status 'unreserved'" in line, line
    assert "max_slot_wal_keep_size 1.0 MB" in line and "next checkpoint invalidates it" in line, line

    rig.src("CHECKPOINT")  # invalidated: the stop the appliers always made
    info = _status(rig)
    assert info["slot_wal_status"] == "lost" and info["slot_warnings"] == [], info
    assert _slot_line(rig).startswith("fail  slot state: ")
    r = rig.applier("run", timeout=60)
    assert r.returncode == 6, r.stdout + r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("applier: error: ")]
    assert len(errors) == 1 and "was invalidated on the source" in errors[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(max(_installs()) < 18, reason="idle_replication_slot_timeout is PostgreSQL 18's")
def test_an_idle_slot_against_idle_replication_slot_timeout(tmp_path: Path) -> None:
    pg18 = find_install(max(_installs()))
    with _own(pg18, "sh-idle", idle_replication_slot_timeout="5s") as db:
        rig = Rig.make(db, None, tmp_path)
        rig.prepare("init")
        info = _status(rig)
        assert info["idle_replication_slot_timeout"] == 5 and info["max_slot_wal_keep_size"] == -1, info
        assert "max_slot_wal_keep_size: -1 (unlimited)" in rig.applier("status").stdout
        # (not through status: its lag read peeks the slot, which PostgreSQL counts as a use)
        _wait_for("the slot idle for 80% of the timeout", lambda: rig.src(
            "SELECT now() - inactive_since >= interval '4.2 s' FROM pg_replication_slots WHERE slot_name = %s",
            [SLOT])[0][0])
        line = _slot_line(rig)
        assert line.startswith("warn") and f"slot '{SLOT}' has been idle for " in line, line
        assert "of idle_replication_slot_timeout 5s" in line and "max_slot_wal_keep_size -1 (unlimited)" in line, line
        _wait_for("the slot idle past the timeout", lambda: rig.src(
            "SELECT now() - inactive_since > interval '5.5 s' FROM pg_replication_slots WHERE slot_name = %s",
            [SLOT])[0][0])
        rig.src("CHECKPOINT")  # the timeout passed: a checkpoint invalidates it
        r = rig.applier("run", timeout=60)
        assert r.returncode == 6, r.stdout + r.stderr
        assert "was invalidated on the source (idle_timeout" in r.stderr, r.stderr


def test_the_daemon_warns_once_when_its_slot_crosses_into_unreserved(kept: ScratchDb, tmp_path: Path) -> None:
    rig = Rig.make(kept, None, tmp_path)
    rig.src("CREATE TABLE hold (id int)")  # not published
    rig.prepare("init")
    port = free_port()
    daemon = rig.start("run", "--metrics", f"127.0.0.1:{port}")
    # an open source transaction holds the slot's restart_lsn back while the daemon applies everything after it
    with psycopg.connect(kept.dsn) as holder:
        holder.execute("INSERT INTO hold VALUES (1)")
        try:
            _wait_for("the daemon to stream", lambda: rig.src(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", [SLOT]))
            samples = scrape(port)
            assert value(samples, "applier_slot_wal_status", status="reserved") == 1, samples
            assert value(samples, "applier_slot_max_wal_keep_size_bytes") == KEEP
            rig.src("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 100) g")
            rig.src("SELECT pg_switch_wal()")
            rig.src("INSERT INTO t VALUES (101, 'after the switch')")
            _wait_for("the rows applied", lambda: len(rig.tgt("SELECT id FROM t")) == 101)
            _wait_for("the metrics to see it", lambda: value(scrape(port), "applier_slot_wal_status",
                                                             status="unreserved") == 1, timeout=20)
            samples = scrape(port)
            assert value(samples, "applier_slot_wal_status", status="reserved") == 0
            retained = value(samples, "applier_slot_retained_bytes")
            assert retained is not None and retained > KEEP, samples
            time.sleep(6)  # the daemon reads the slot again (every 5 s): no second warning
            rig.src("CHECKPOINT")  # invalidated under the running daemon: the stop it always made
            out, err = daemon.communicate(timeout=60)
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                daemon.communicate(timeout=30)
            holder.rollback()
    assert daemon.returncode == 6, err
    warned = [x for x in err.splitlines() if "wal_status 'unreserved'" in x]
    assert len(warned) == 1 and "WARNING" in warned[0] and f"slot '{SLOT}'" in warned[0], err
    assert "max_slot_wal_keep_size 1.0 MB" in warned[0], warned
    errors = [x for x in err.splitlines() if x.startswith("applier: error: ")]
    assert len(errors) == 1 and "was invalidated on the source" in errors[0] and "Traceback" not in err, err
