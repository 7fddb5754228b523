"""Which failures of a target pass by themselves (``FAILURES`` of ``applier.targets.postgres`` / ``sqlite``): real
errors of a real PostgreSQL server and a real SQLite file, raw and as the engine wraps them (an ApplyError caused by
the driver's error). A failure that passes is retried with backoff as a connection problem; any other is about what
was applied (README: "Failures are told apart by what the server says")."""

from __future__ import annotations

import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from applier.errors import ApplyError
from applier.targets.contract import Failures
from applier.targets.postgres.target import FAILURES as PG
from applier.targets.sqlite.target import FAILURES as SQLITE
from tests.plugins.clusters import ScratchDb


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raised(failures: Failures, action: Callable[[], object]) -> BaseException:
    """The error ``action`` raises, which must be one of ``failures.errors``."""
    with pytest.raises(failures.errors) as caught:
        action()
    return caught.value


def wrapped(exc: BaseException) -> ApplyError:
    """``exc`` as the engine reports a target's failure."""
    try:
        raise ApplyError(f"commit failed on the target: {exc}") from exc
    except ApplyError as err:
        return err


def assert_transient(failures: Failures, exc: BaseException, transient: bool) -> None:
    assert failures.is_transient(exc) is transient, exc
    assert failures.is_transient(wrapped(exc)) is transient, exc


@pytest.fixture
def pg(target_db: ScratchDb) -> Iterator[psycopg.Connection]:
    conn = psycopg.connect(target_db.dsn, autocommit=True)
    yield conn
    conn.close()


def test_a_lost_or_refused_connection_passes(target_db: ScratchDb, pg: psycopg.Connection) -> None:
    victim = psycopg.connect(target_db.dsn, autocommit=True)
    pg.execute("SELECT pg_terminate_backend(%s)", [victim.info.backend_pid])
    assert_transient(PG, raised(PG, lambda: victim.execute("SELECT 1")), True)  # 57P01, or the connection lost
    victim.close()
    refused = raised(PG, lambda: psycopg.connect(f"host=127.0.0.1 port={closed_port()} dbname=x connect_timeout=2"))
    assert_transient(PG, refused, True)


def test_a_lock_timeout_passes(target_db: ScratchDb, pg: psycopg.Connection) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    with psycopg.connect(target_db.dsn) as holder:
        holder.execute("LOCK TABLE t")  # held until the transaction ends
        with psycopg.connect(target_db.dsn) as waiter:
            waiter.execute("SET lock_timeout = '50ms'")
            exc = raised(PG, lambda: waiter.execute("LOCK TABLE t"))
    assert getattr(exc, "sqlstate", None) == "55P03"
    assert_transient(PG, exc, True)


def test_a_refused_change_does_not_pass(pg: psycopg.Connection) -> None:
    pg.execute("CREATE TABLE t (id int, v text)")
    pg.execute("CREATE UNIQUE INDEX ON t (id)")
    pg.execute("INSERT INTO t VALUES (1, 'a')")
    pg.execute("CREATE PUBLICATION refuses FOR TABLE t")  # a table without a replica identity refuses updates
    try:
        no_identity = raised(PG, lambda: pg.execute("UPDATE t SET v = 'b'"))
        assert getattr(no_identity, "sqlstate", None) == "55000"
        assert_transient(PG, no_identity, False)
        collision = raised(PG, lambda: pg.execute("INSERT INTO t VALUES (1, 'c')"))
        assert getattr(collision, "sqlstate", None) == "23505"
        assert_transient(PG, collision, False)
    finally:
        pg.execute("DROP PUBLICATION refuses")


def test_a_locked_sqlite_file_passes_and_a_refused_row_does_not(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    holder.execute("INSERT INTO t VALUES (1)")
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=0.05)
    try:
        locked = raised(SQLITE, lambda: waiter.execute("BEGIN IMMEDIATE"))
        assert "locked" in str(locked)
        assert_transient(SQLITE, locked, True)
        holder.execute("ROLLBACK")
        collision = raised(SQLITE, lambda: waiter.execute("INSERT INTO t VALUES (1)"))
        assert_transient(SQLITE, collision, False)
    finally:
        waiter.close()
        holder.close()


def test_each_kind_answers_for_its_own_driver_only(tmp_path: Path) -> None:
    """A PostgreSQL target does not take a SQLite error for its own, nor the reverse."""
    locked = sqlite3.OperationalError("database is locked")
    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    assert SQLITE.is_transient(locked) and not PG.is_transient(locked)
    assert PG.is_transient(lost) and not SQLITE.is_transient(lost)
    assert not PG.is_transient(ApplyError("cannot apply UPDATE: no key")) and not SQLITE.is_transient(ApplyError("x"))
