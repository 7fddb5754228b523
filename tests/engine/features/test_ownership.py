"""One applier per progress row, one consumer per slot, and what `status` and `skip` tell an operator.

Exactly-once across processes: the progress row of an ``apply.name`` is claimed by whoever applies
(an advisory lock on a PostgreSQL target, a lock file beside a SQLite target) and belongs to one
slot; a second applier is refused before it applies anything, with one line naming the holder.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from applier.admin import skip, status
from applier.config import ConfigError
from applier.engine.runner import Runner
from applier.errors import InUseError
from applier.source.base import SlotInUseError
from applier.targets import claim
from applier.targets.postgres.claim import pg_lock_key
from tests.engine.features.conftest import Rig
from tests.plugins.cli import popen, run_cli


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _second_slot(rig: Rig) -> str:
    other = rig.slot + "_b"
    rig.src("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [other])
    return other


@contextlib.contextmanager
def _daemon(rig: Rig) -> Iterator[None]:
    """``applier run`` (in-process, a thread) until the block ends; then stopped and joined."""
    stop = threading.Event()
    thread = threading.Thread(target=Runner(rig.cfg(apply_group_commit_delay=0.0), catchup=False, stop=stop).run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def test_a_second_applier_on_one_progress_row_is_refused_before_applying(rig: Rig) -> None:
    """The finding: two appliers (same apply.name and target, different slots) both applied every row."""
    rig.published_table()
    other = _second_slot(rig)
    with _daemon(rig):
        _wait_for(lambda: rig.target_rows() == 100, "the daemon to apply the first rows")
        with pytest.raises(InUseError) as refused:
            Runner(rig.cfg(source_slot=other), catchup=True).run()
        assert "applier run (pid" in str(refused.value) and "apply.name 'applier'" in str(refused.value)
        rig.src("INSERT INTO t SELECT g, 'w' FROM generate_series(101, 150) g")
        _wait_for(lambda: rig.target_rows() == 150, "the daemon to apply the later rows")
    assert rig.target_rows() == 150 and rig.tgt("SELECT count(DISTINCT id) FROM t")[0][0] == 150
    # the daemon is gone, but the progress row follows the first slot: the other slot is refused too
    with pytest.raises(ConfigError, match=f"follows slot '{rig.slot}', not '{other}'"):
        Runner(rig.cfg(source_slot=other), catchup=True).run()
    assert rig.target_rows() == 150


@pytest.mark.parametrize("target_kind", ["postgresql", "sqlite"])
def test_second_process_is_refused_with_one_line_naming_the_first(cli_rig: Rig) -> None:
    """Two `applier` processes: the second exits non-zero naming the first (its pid); nothing is doubled."""
    rig = cli_rig
    rig.published_table()
    other = _second_slot(rig)
    first = popen(["run", "-c", str(rig.config_file(apply_group_commit_delay=0.0))], stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: rig.target_rows() == 100, "the first applier to apply")
        second = run_cli("catchup", "-c", str(rig.config_file("other.toml", source_slot=other)))
        assert second.returncode != 0
        lines = [ln for ln in second.stderr.splitlines() if ln.startswith("applier: error:")]
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"applier run (pid {first.pid} on " in lines[0]
        info = json.loads(run_cli("status", "--json", "-c", str(rig.config_file())).stdout)
        assert f"applier run (pid {first.pid} on " in info["running"]
        rig.src("INSERT INTO t SELECT g, 'w' FROM generate_series(101, 120) g")
        _wait_for(lambda: rig.target_rows() == 120, "the first applier to apply the later rows")
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert rig.tgt("SELECT count(*), count(DISTINCT id) FROM t")[0] == (120, 120)
    info = json.loads(run_cli("status", "--json", "-c", str(rig.config_file())).stdout)
    assert info["running"] is None


def test_a_slot_in_use_is_named_with_its_pid_catchup_ends_and_run_waits(rig: Rig) -> None:
    """Another consumer streams from the slot: catchup exits with the PID, run waits saying so."""
    rig.published_table()
    with _daemon(rig):
        _wait_for(lambda: rig.target_rows() == 100, "the daemon to apply")
        pid = rig.src("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])[0][0]
        # another replica (its own apply.name, so the target's claim does not stop it) on the same slot
        catchup = run_cli("catchup", "-c", str(rig.config_file("b.toml", apply_name="b")))
        assert catchup.returncode != 0 and "Traceback" not in catchup.stderr
        lines = [ln for ln in catchup.stderr.splitlines() if ln.startswith("applier: error:")]
        assert len(lines) == 1 and f"replication slot '{rig.slot}' is in use: active for PID {pid}" in lines[0]
        with pytest.raises(SlotInUseError, match=f"active for PID {pid}"):  # through the SQL interface too
            Runner(rig.cfg(apply_name="c", source_sql_interface=True), catchup=True).run()
        waiting = popen(["run", "-c", str(rig.config_file("b.toml", apply_name="b", apply_retry_initial=0.2))],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(4)
        waiting.send_signal(signal.SIGTERM)
        _, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert "is in use: active for PID" in err and "waiting" in err and "connection problem" not in err
    assert rig.target_rows() == 100


def test_status_after_init_behind_and_caught_up(rig: Rig) -> None:
    """Lag is 0 when everything sent is applied; otherwise bytes behind and the age of the oldest change."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("CREATE TABLE unpublished (x int); INSERT INTO unpublished SELECT generate_series(1, 20000)")
    info = status(rig.cfg())
    confirmed = rig.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                        [rig.slot])[0][0]
    assert info["applied_lsn"] == confirmed  # nothing applied yet: the stream starts at the slot's position
    assert (info["lag_bytes"], info["lag_seconds"], info["running"]) == (0, 0.0, None)
    rig.src("INSERT INTO t VALUES (1, 'a')")
    time.sleep(2.0)
    rig.src("INSERT INTO t VALUES (2, 'b')")
    behind = status(rig.cfg())
    assert behind["lag_bytes"] > 0 and 2.0 <= behind["lag_seconds"] < 30, behind
    rig.catchup()
    caught_up = status(rig.cfg())
    assert (caught_up["lag_bytes"], caught_up["lag_seconds"]) == (0, 0.0), caught_up
    assert caught_up["applied_lsn"] == str(rig.progress_lsn()) and caught_up["last_error"] is None


def test_status_shows_the_last_error_and_when(rig: Rig) -> None:
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v text CHECK (v <> 'bad'))")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'bad')")
    with pytest.raises(Exception, match="bad"):
        rig.catchup()
    info = status(rig.cfg())
    assert "INSERT on table public.t" in info["last_error"] and "(id)=(1)" in info["last_error"]
    assert info["last_error_at"].startswith(time.strftime("%Y-%m-%d", time.gmtime()))
    assert info["lag_bytes"] > 0 and info["lag_seconds"] >= 0


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_status_exits_non_zero_when_the_slot_is_missing(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    ok = run_cli("status", "-c", str(rig.config_file()))
    assert ok.returncode == 0 and "lag_bytes: 0" in ok.stdout and "running: -" in ok.stdout, ok.stdout + ok.stderr
    rig.src("SELECT pg_drop_replication_slot(%s)", [rig.slot])
    gone = run_cli("status", "--json", "-c", str(rig.config_file()))
    assert gone.returncode == 6 and json.loads(gone.stdout)["slot_exists"] is False  # 6: the slot is gone
    assert gone.stderr.strip().count("\n") == 0 and f"slot '{rig.slot}' does not exist" in gone.stderr, gone.stderr


def test_skip_refuses_a_transaction_already_applied(rig: Rig) -> None:
    rig.published_table(3)
    rig.catchup()
    applied = rig.progress_lsn()
    with pytest.raises(ConfigError, match=f"already at {applied}"):
        skip(rig.cfg(), applied - 1)
    assert skip(rig.cfg(), applied).startswith(f"the transaction finished at {applied} will be skipped")


@pytest.mark.parametrize("target_kind", ["postgresql"])
def test_a_claim_left_by_a_killed_applier_is_taken_over(rig: Rig) -> None:
    """A killed applier's target backend may hold the advisory lock a while: a restart on this host takes over."""
    rig.published_table(10)
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert rig.target is not None
    stale = psycopg.connect(rig.target.dsn, autocommit=True)
    try:
        stale.execute("SELECT set_config('application_name', %s, false)",
                      [f"applier run (pid {dead.pid} on {socket.gethostname()})"])
        stale.execute("SELECT pg_advisory_lock(%s)", [pg_lock_key("applier")])
        rig.catchup()
        assert rig.target_rows() == 10
        with pytest.raises(psycopg.OperationalError):  # its backend was terminated
            stale.execute("SELECT 1")
    finally:
        stale.close()


def test_a_slot_made_again_past_the_target_is_refused(rig: Rig) -> None:
    """A slot recreated under its name starts after what the target holds: the gap would be lost silently."""
    rig.published_table(5)
    rig.catchup()
    applied = rig.progress_lsn()
    rig.src("SELECT pg_drop_replication_slot(%s)", [rig.slot])
    rig.src("INSERT INTO t VALUES (6, 'lost')")  # committed while no slot existed: no slot can deliver it
    rig.src("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [rig.slot])
    for sql_interface in (False, True):
        with pytest.raises(ConfigError, match=f"confirmed up to .* past the target's progress for 'applier' at {applied}"):
            Runner(rig.cfg(source_sql_interface=sql_interface), catchup=True).run()
    assert rig.target_rows() == 5


@pytest.mark.parametrize("target_kind", ["postgresql"])
def test_a_connection_this_process_lost_does_not_lock_it_out(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our own earlier session (dropped on the client side, its backend still there) is stale, long host names too."""
    monkeypatch.setattr(claim.socket, "gethostname", lambda: "ip-10-0-12-34.eu-west-1.compute.internal.example")
    rig.published_table(4)
    assert rig.target is not None
    lost = psycopg.connect(rig.target.dsn, autocommit=True)
    try:
        lost.execute("SELECT set_config('application_name', %s, false)", [claim.who_am_i("run", 63)])
        lost.execute("SELECT pg_advisory_lock(%s)", [pg_lock_key("applier")])
        rig.catchup()
        assert rig.target_rows() == 4
        with pytest.raises(psycopg.OperationalError):
            lost.execute("SELECT 1")
    finally:
        lost.close()
