"""A refusal by the target is an apply failure, not a connection problem to wait out.

What a user sees: a target table in a target ``FOR ALL TABLES`` publication without a replica identity refuses
every UPDATE (SQLSTATE 55000, object_not_in_prerequisite_state): the state of an object, which no retry changes.
``applier catchup`` stops at once with one line naming the change, the table, the key and the transaction's
finish LSN, and exits non-zero (no "connection problem" retries); ``applier run`` with ``on_error = "stop"``
stops the same way. Nothing of the refused transaction is applied.
"""

from __future__ import annotations

import threading
import time

import pytest

from applier.engine.runner import Runner
from applier.errors import ApplyError
from applier.lsn import LSN
from tests.plugins.cli import run_cli

from .conftest import Rig
from .test_skip_and_errors import FINISHED_AT, error_line

pytestmark = pytest.mark.parametrize("target_kind", ["postgresql"])


def refused_update(rig: Rig) -> tuple[LSN, LSN]:
    """An UPDATE the target refuses (its table has no replica identity and is published there); the WAL positions
    before and after the source transaction."""
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt_script("CREATE TABLE t (id int, v text); CREATE PUBLICATION everything FOR ALL TABLES")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a')")
    rig.catchup()  # an insert needs no replica identity
    before = rig.wal_lsn()
    rig.src("UPDATE t SET v = 'b' WHERE id = 1")
    return before, rig.wal_lsn()


def test_catchup_stops_at_once_naming_the_refused_change(cli_rig: Rig) -> None:
    rig = cli_rig
    before, after = refused_update(rig)
    started = time.monotonic()
    failed = run_cli("catchup", "-c", str(rig.config_file()))
    took = time.monotonic() - started
    assert failed.returncode != 0
    assert "connection problem" not in failed.stderr, failed.stderr
    line = error_line(failed.stderr)
    assert "UPDATE on table public.t (key (id)=(1))" in line and "replica identity" in line, line
    m = FINISHED_AT.search(line)
    assert m and before < LSN.parse(m.group(1)) <= after, line
    assert took < 15, f"catchup took {took:.1f}s:\n{failed.stderr}"  # no retries with backoff (1+2+4+8+16 s)
    assert rig.tgt("SELECT id, v FROM t") == [(1, "a")]


def test_run_with_on_error_stop_stops_at_the_refused_change(rig: Rig) -> None:
    refused_update(rig)
    runner = Runner(rig.cfg(apply_on_error="stop"), catchup=False)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    daemon = threading.Thread(target=run, daemon=True)
    daemon.start()
    daemon.join(20)
    if daemon.is_alive():
        runner.stop.set()
        daemon.join(30)
        pytest.fail(f"`run` with on_error = \"stop\" kept retrying the refused change: {runner.summary.errors}")
    assert len(outcome) == 1 and isinstance(outcome[0], ApplyError), outcome
    assert "UPDATE on table public.t (key (id)=(1))" in str(outcome[0]) and "replica identity" in str(outcome[0])
    assert rig.tgt("SELECT id, v FROM t") == [(1, "a")]
