"""How the runner sorts what ended a session: as the side it came from says (``Runner.is_transient``,
``Runner.error_kind``), with real errors of the real drivers. A failure that passes by itself is a connection
problem (retried with backoff; ``applier_errors_total{kind="connection"}``), any other an apply failure."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import pytest

from applier.config import load_config
from applier.engine.runner import Runner
from applier.errors import ApplyError, SlotLost, TargetUnreachable
from applier.source.base import SourceError, SourceUnreachable, StreamOptions
from applier.source.sql import SqlSlotSource
from applier.targets.postgres.target import PostgresTarget


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runner(url: str, tmp_path: Path) -> Runner:
    cfg = load_config(None, {"source.dsn": f"host=127.0.0.1 port={closed_port()} dbname=src", "source.slot": "s",
                             "target.url": url, "apply.work_dir": str(tmp_path)}, env={})
    return Runner(cfg, catchup=True)


def caused(exc: BaseException) -> ApplyError:
    """``exc`` as the engine reports a target's failure."""
    try:
        raise ApplyError(f"commit failed on the target: {exc}") from exc
    except ApplyError as err:
        return err


def test_a_database_out_of_reach_is_a_connection_problem(tmp_path: Path) -> None:
    r = runner(f"postgresql://u@127.0.0.1:{closed_port()}/t?connect_timeout=2", tmp_path)
    with pytest.raises(TargetUnreachable) as target:
        PostgresTarget(f"postgresql://u@127.0.0.1:{closed_port()}/t?connect_timeout=2", "applier")
    with pytest.raises(SourceUnreachable) as source:
        SqlSlotSource(f"host=127.0.0.1 port={closed_port()} dbname=x connect_timeout=2", "s", StreamOptions(("p",)))
    for exc in (target.value, source.value, caused(source.value), SourceError("source refused START_REPLICATION")):
        assert isinstance(exc, r.failures)
        assert r.is_transient(exc) and r.error_kind(exc) == "connection", exc
    lost = SlotLost("s", "was dropped")
    assert isinstance(lost, r.failures) and not r.is_transient(lost) and r.error_kind(lost) == "slot_lost"
    refused = ApplyError("cannot apply UPDATE to table public.t at LSN 0/1: no key")
    assert not r.is_transient(refused) and r.error_kind(refused) == "apply"


def test_a_locked_sqlite_target_is_a_connection_problem(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    r = runner(f"sqlite:///{path}", tmp_path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=0.05)
    try:
        with pytest.raises(r.failures) as locked:
            waiter.execute("BEGIN IMMEDIATE")
    finally:
        waiter.close()
        holder.close()
    assert r.is_transient(locked.value) and r.is_transient(caused(locked.value))
    assert r.error_kind(caused(locked.value)) == "connection"
    unopened = ApplyError(f"cannot open the SQLite target {tmp_path}/missing/t.db: unable to open database file")
    assert not r.is_transient(unopened) and r.error_kind(unopened) == "apply"
