"""What an operator meets when something goes away (issue 25): a lost slot, two writers past the claim, an
outage while the daemon retries, a database restarting when it starts.

Everything is real: the slot is dropped or invalidated on the source server, the walsender is
terminated, a cluster is stopped and started again.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from applier.admin import check_source, check_target, init, status
from applier.config import Config, ConnectError
from applier.engine.runner import Runner, Summary
from applier.errors import ConflictStopped, InUseError, ProgressMoved, SlotLost
from applier.lsn import LSN
from applier.metrics import Metrics
from applier.migrate.sync import sync
from applier.sandbox.clusters import find_install
from applier.source.base import stream_options
from applier.source.walsender import WalSender
from applier.targets import opener
from tests.engine.features.conftest import Rig
from tests.plugins.cli import popen, run_cli
from tests.plugins.clusters import ClusterPool, scratch_db


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Daemon:
    """``applier run`` in a thread of the test process: its summary, or what it raised."""

    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        self.stop = threading.Event()
        self.runner = Runner(cfg, catchup=False, stop=self.stop, metrics=metrics)
        self.summary: Summary | None = None
        self.raised: BaseException | None = None
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            self.summary = self.runner.run()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.raised = exc


@contextlib.contextmanager
def _daemon(cfg: Config, metrics: Metrics | None = None) -> Iterator[Daemon]:
    d = Daemon(cfg, metrics)
    d.thread.start()
    try:
        yield d
    finally:
        d.stop.set()
        d.thread.join(60)
        assert not d.thread.is_alive()


def _kill_walsender(rig: Rig) -> None:
    """Terminate the walsender streaming from the slot (the daemon loses its source connection)."""
    _wait_for(lambda: bool(rig.src("SELECT active FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])[0][0]),
              "the slot to be streamed from")
    rig.src("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])


def _drop_slot(rig: Rig) -> None:
    """Drop the slot, terminating its walsender first if one streams from it."""
    deadline = time.monotonic() + 30
    while True:
        rig.src("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s "
                "AND active_pid IS NOT NULL", [rig.slot])
        try:
            rig.src("SELECT pg_drop_replication_slot(%s)", [rig.slot])
            return
        except Exception:  # noqa: BLE001 - still active for a moment: try again
            assert time.monotonic() < deadline
            time.sleep(0.1)


# -- a lost slot -----------------------------------------------------------------------------------

def test_a_dropped_slot_stops_run_and_catchup_naming_it(rig: Rig) -> None:
    """The finding: a dropped slot gave "connection problem, retrying" forever. Now one line naming the slot, what
    happened to it, the applied position and what to do; run stops, catchup fails; a metric counts it."""
    rig.published_table()
    metrics = Metrics()
    with _daemon(rig.cfg(apply_retry_initial=0.2), metrics) as d:
        _wait_for(lambda: rig.target_rows() == 100, "the daemon to apply")
        applied = rig.progress_lsn()
        _drop_slot(rig)
        rig.src("INSERT INTO t VALUES (101, 'after')")
        d.thread.join(30)
        assert not d.thread.is_alive(), "run went on retrying a slot that is gone"
    assert isinstance(d.raised, SlotLost), d.raised
    line = str(d.raised)
    assert f"replication slot '{rig.slot}' does not exist on the source" in line
    assert f"applied up to {applied}" in line and "applier sync --force" in line and "--new-slot" in line
    assert metrics.registry.get_sample_value("applier_errors_total", {"kind": "slot_lost"}) == 1
    # the walsender terminated to drop the slot: one lost connection, retried once, then no more
    assert metrics.registry.get_sample_value("applier_errors_total", {"kind": "connection"}) == 1
    with pytest.raises(SlotLost, match=f"slot '{rig.slot}' does not exist"):
        rig.catchup()
    assert status(rig.cfg())["last_error"].startswith(f"replication slot '{rig.slot}' does not exist")
    r = run_cli("catchup", "-c", str(rig.config_file()))  # the command: one line, non-zero
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("applier: error:")]
    assert r.returncode == 6 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"applier: error: replication slot '{rig.slot}' does not exist"), lines
    assert rig.target_rows() == 100


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_an_invalidated_slot_is_named_as_such(pg_clusters: ClusterPool, pg_install: Any, target_kind: str,
                                              tmp_path: Any) -> None:
    """A slot whose WAL was removed (max_slot_wal_keep_size): the catalog's wal_status 'lost' / invalidation_reason,
    and the walsender's own refusal ("can no longer get changes"), are both a SlotLost saying it was invalidated."""
    cluster = pg_clusters.get(pg_install, "small-wal", settings={"max_slot_wal_keep_size": "1MB"})
    with scratch_db(cluster, "src") as source:
        rig = Rig(source, target_kind, None, tmp_path)
        rig.published_table()
        rig.catchup()
        for _ in range(20):  # WAL past what the slot may keep, removed at a checkpoint
            if rig.src("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])[0][0] == "lost":
                break
            rig.src("INSERT INTO t SELECT g, repeat('x', 500) FROM generate_series(1000, 5000) g "
                    "ON CONFLICT (id) DO UPDATE SET v = excluded.v")
            rig.src("SELECT pg_switch_wal()")
            rig.src("CHECKPOINT")
        assert rig.src("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])[0][0] == "lost"
        with pytest.raises(SlotLost, match=f"slot '{rig.slot}' was invalidated on the source") as lost:
            rig.catchup()
        assert f"applied up to {rig.progress_lsn()}" in str(lost.value)
        ws = WalSender(source.dsn)  # what the walsender itself says when asked to stream from it
        try:
            with pytest.raises(SlotLost, match=f"slot '{rig.slot}' was invalidated on the source"):
                ws.start(rig.slot, rig.progress_lsn(), stream_options(rig.cfg()))
        finally:
            ws.close()


def test_init_after_a_lost_slot_refuses_unless_new_slot_which_status_remembers(rig: Rig) -> None:
    """The finding: init made a new slot and exited 0, silently losing the changes in between."""
    rig.published_table()
    rig.catchup()
    applied = rig.progress_lsn()
    _drop_slot(rig)
    rig.src("INSERT INTO t VALUES (101, 'lost')")  # never reaches the replica
    with pytest.raises(SlotLost) as refused:
        rig.init()
    line = str(refused.value)
    assert f"slot '{rig.slot}' does not exist" in line and f"between {applied} and it" in line
    assert rig.src("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", [rig.slot]) == [(0,)]
    assert status(rig.cfg())["recopy_needed"] is None
    done = init(rig.cfg(), new_slot=True)
    assert any(ln.startswith(f"slot '{rig.slot}': created at") for ln in done)
    assert any(ln.startswith("re-copy needed:") for ln in done)
    why = status(rig.cfg())["recopy_needed"]
    assert why is not None and str(applied) in why and "applier sync --force" in why
    init(rig.cfg())  # a second init keeps the mark: nothing was copied
    rig.src("INSERT INTO t VALUES (102, 'after')")
    rig.catchup()  # the replica follows from the new slot, the gap (101) stays until a copy
    assert rig.tgt("SELECT id FROM t WHERE id > 100") == [(102,)]
    assert status(rig.cfg())["recopy_needed"] == why
    if rig.kind == "sqlite":  # a completed copy clears it (SQLite: no Spark needed)
        sync(rig.cfg(), force=True)
        assert status(rig.cfg())["recopy_needed"] is None
        assert rig.tgt("SELECT id, v FROM t WHERE id > 100 ORDER BY id") == [(101, "lost"), (102, "after")]


# -- two writers, the claim --------------------------------------------------------------------------

def test_two_sessions_past_the_claim_cannot_both_advance_the_progress(rig: Rig) -> None:
    """The compare-and-set: a session whose progress row was moved by another commits nothing."""
    rig.published_table()
    rig.catchup()
    at = rig.progress_lsn()
    first, second = opener.open(rig.cfg()), opener.open(rig.cfg())
    try:
        first.read_progress()
        second.read_progress()  # both read the same position (no claim taken: forced past it)
        first.begin()
        first.write_progress(LSN(at + 100), None)
        first.commit(LSN(at + 100))
        second.begin()
        second.cur.execute("INSERT INTO t VALUES (999, 'twice')")
        with pytest.raises(ProgressMoved, match=f"no longer at {at}, where this session read it"):
            second.write_progress(LSN(at + 200), None)
            second.commit(LSN(at + 200))
        second.rollback()
    finally:
        first.close()
        second.close()
    assert rig.progress_lsn() == at + 100
    assert rig.tgt("SELECT count(*) FROM t WHERE id = 999") == [(0,)]


def test_the_claim_is_held_through_retries(rig: Rig) -> None:
    """The finding: while `run` waited to retry, status showed nobody and a second applier ran beside it."""
    rig.published_table()
    with _daemon(rig.cfg(apply_retry_initial=8.0)):
        _wait_for(lambda: rig.target_rows() == 100, "the daemon to apply")
        _kill_walsender(rig)
        time.sleep(1.0)  # the session has ended; the daemon waits 8 s before the next
        assert (status(rig.cfg())["running"] or "").startswith("applier run (pid")
        with pytest.raises(InUseError, match="applier run \\(pid"):
            rig.catchup()


# -- outages ---------------------------------------------------------------------------------------

def test_lag_grows_during_an_outage_and_the_databases_are_probed(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """The finding: lag froze at its last value while the source went on; now the source's WAL position is read
    between sessions, with reachability gauges and the WAL the slot retains. The outage's end is logged with
    its length, the start with one line."""
    rig.published_table()
    metrics = Metrics()
    caplog.set_level(logging.INFO, logger="applier.runner")
    with _daemon(rig.cfg(apply_retry_initial=6.0), metrics):
        _wait_for(lambda: rig.target_rows() == 100, "the daemon to apply")
        _kill_walsender(rig)
        time.sleep(0.5)
        rig.src("INSERT INTO t SELECT g, repeat('y', 200) FROM generate_series(101, 2000) g")
        lag = metrics.registry.get_sample_value("applier_lag_bytes")
        assert lag is not None and lag > 2000 * 200
        assert metrics.registry.get_sample_value("applier_source_reachable") == 1
        assert metrics.registry.get_sample_value("applier_target_reachable") == 1
        retained = metrics.registry.get_sample_value("applier_slot_retained_bytes")
        assert retained is not None and retained > 0
        _wait_for(lambda: rig.target_rows() == 2000, "the daemon to apply after the outage")
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("applier run: source ")]
    assert len(started) == 1 and f"slot '{rig.slot}'" in started[0] and "row path" in started[0]
    assert "password" not in started[0]
    assert any(r.getMessage().startswith("connected again after an outage of ") for r in caplog.records)
    assert status(rig.cfg())["slot_retained_bytes"] >= 0


@pytest.mark.parametrize("down", ["source", "target"])
def test_run_waits_for_a_database_that_is_down_at_start(pg_clusters: ClusterPool, tmp_path: Any, down: str) -> None:
    """The finding: `run` started while the source or the target restarted exited 2; now it waits with backoff,
    and catchup fails at once (``ConnectError``)."""
    install = find_install()
    cluster = pg_clusters.get(install, "restarting")  # the one that goes down: source or target
    other = pg_clusters.get(install, "source" if down == "target" else "target")
    with scratch_db(cluster, "down") as gone, scratch_db(other, "up") as up:
        rig = Rig(gone, "sqlite", None, tmp_path) if down == "source" else Rig(up, "postgresql", gone, tmp_path)
        rig.published_table()
        cluster.kill()  # as a crash: start() recovers it with its data
        try:
            cfg = rig.cfg(apply_retry_initial=0.5)

            def checks() -> None:
                check_source(cfg)
                check_target(cfg)

            with pytest.raises(ConnectError, match="cannot connect to the source" if down == "source"
                               else "cannot open the target"):
                Runner(cfg, catchup=True).preflight(checks)
            stop = threading.Event()
            runner = Runner(cfg, catchup=False, stop=stop)
            ready: list[bool] = []

            def daemon() -> None:
                ready.append(runner.preflight(checks))
                runner.run()

            thread = threading.Thread(target=daemon)
            thread.start()
            time.sleep(2.0)
            assert thread.is_alive() and not ready
        finally:
            cluster.start()
        try:
            _wait_for(lambda: rig.target_rows() == 100, f"run to apply once the {down} is back")
        finally:
            stop.set()
            thread.join(60)
        assert ready == [True]


# -- small items ---------------------------------------------------------------------------------------

def test_a_conflict_stopped_by_the_error_policy_is_counted(rig: Rig) -> None:
    rig.published_table(0)
    rig.tgt_script("INSERT INTO t VALUES (1, 'local')")
    rig.src("INSERT INTO t VALUES (1, 'remote')")
    metrics = Metrics()
    with pytest.raises(ConflictStopped, match="insert_exists"):
        Runner(rig.cfg(), catchup=True, metrics=metrics).run()
    counted = {(s.labels["type"], s.labels["table"]): s.value for m in metrics.registry.collect()
              if m.name == "applier_conflicts" for s in m.samples if s.name == "applier_conflicts_total"}
    assert counted == {("insert_exists", "t" if rig.kind == "sqlite" else "public.t"): 1}, counted


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_sighup_stops_run_with_its_summary(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.published_table()
    daemon = popen(["run", "-c", str(rig.config_file())], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: rig.sqlite_path.exists() and rig.target_rows() == 100, "run to apply")
    finally:
        daemon.send_signal(signal.SIGHUP)
        out, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err
    assert out.startswith("applied 1 transactions, 100 rows"), out
