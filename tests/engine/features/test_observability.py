"""What an operator watches (issue 16, items 1 and 2): Prometheus metrics and JSON log lines of ``applier run``.

The installed ``applier`` script runs as a daemon against the real clusters (newest PostgreSQL source, both
target kinds). The metrics are scraped by a real HTTP client (urllib) and read with prometheus_client's own
parser of the text format. The target is blocked for real: an EXCLUSIVE lock on the table on a
PostgreSQL target, a write transaction (BEGIN IMMEDIATE) on the SQLite file. Bad input is the script's one line and exit 2.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from applier import __version__
from applier._cmodule import IMPLEMENTATION
from applier.metrics import Metrics
from tests.engine.test_crash import slot_state
from tests.plugins.cli import popen, run_cli

from .conftest import Rig

SECRET = "sekret"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Samples:
    """Every sample of http://127.0.0.1:port/metrics, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def by_label(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(dict(lab)[k] for k in keys): v for (n, lab), v in samples.items() if n == name and v}


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60, proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the daemon exited with {proc.returncode}:\n{log.read_text() if log else ''}")
        try:
            last = check()
        except OSError as exc:  # the metrics server is not up yet
            last = exc
        if last and not isinstance(last, OSError):
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}\n{log.read_text() if log else ''}")


def scrape_until(port: int, what: str, pred: Callable[[Samples], bool], proc: subprocess.Popen[bytes],
                 log: Path) -> Samples:
    """The first scrape for which ``pred`` holds."""
    def check() -> Samples | None:
        samples = scrape(port)
        return samples if pred(samples) else None
    return wait_for(what, check, proc=proc, log=log)  # type: ignore[no-any-return]


@contextmanager
def daemon(rig: Rig, config: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``applier run -c config args…`` streaming (stderr to a file); SIGTERM and exit 0 at the end."""
    err = rig.tmp / "daemon.err"
    with err.open("wb") as out:
        proc = popen(["run", "-c", str(config), *args], stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    try:
        wait_for("the daemon to stream", lambda: slot_state(rig.source, rig.slot)[0], proc=proc, log=err)
        yield proc, err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@contextmanager
def blocked_target(rig: Rig) -> Iterator[None]:
    """The target table t cannot be written while inside (it can be read): a lock held by another session."""
    if rig.target is not None:
        with psycopg.connect(rig.target.dsn) as conn:
            conn.execute("LOCK TABLE t IN EXCLUSIVE MODE")
            yield
            conn.rollback()
    else:
        db = sqlite3.connect(rig.sqlite_path, timeout=30, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")  # the file's write lock
            yield
            db.execute("ROLLBACK")
        finally:
            db.close()


def test_metrics_of_a_running_daemon(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.both("CREATE TABLE u (id int PRIMARY KEY)")
    rig.src("CREATE TABLE other (id serial, v text)")  # not published: WAL that moves only the progress
    rig.publish("t", "u")
    rig.init()
    port = free_port()
    # one source transaction a group: a batch folds changes to one row across the transactions of a group (an
    # insert then an update of it is written as one insert), and the metrics count the rows written
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}", apply_group_commit_delay=0.0,
                             source_status_interval=0.5)
    table = {"t": "public.t", "u": "public.u"} if rig.kind == "postgresql" else {"t": "t", "u": "u"}
    with daemon(rig, config) as (proc, err):
        first = wait_for("the metrics endpoint", lambda: scrape(port), proc=proc, log=err)
        assert value(first, "applier_build_info", version=__version__, row_path=IMPLEMENTATION) == 1
        rig.src("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 50) g")
        rig.src("UPDATE t SET v = 'new' WHERE id <= 10")
        rig.src("DELETE FROM t WHERE id BETWEEN 41 AND 45")
        rig.src("INSERT INTO u SELECT g FROM generate_series(1, 20) g")
        wait_for("u on the target", lambda: rig.tgt("SELECT count(*) FROM u")[0][0] == 20)
        rig.tgt("DELETE FROM u WHERE id = 20")  # the source's delete will not find it: delete_missing
        rig.src("DELETE FROM u WHERE id = 20")
        done = scrape_until(port, "the conflict", lambda m: bool(by_label(m, "applier_conflicts_total", "type",
                                                                             "table")), proc, err)
        assert by_label(done, "applier_rows_written_total", "operation", "table") == {
            ("insert", table["t"]): 50, ("update", table["t"]): 10, ("delete", table["t"]): 5,
            ("insert", table["u"]): 20}
        assert by_label(done, "applier_conflicts_total", "type", "table") == {("delete_missing", table["u"]): 1}
        assert value(done, "applier_transactions_applied_total") == 5
        assert value(done, "applier_group_size_transactions_sum") == 5
        assert value(done, "applier_errors_total", kind="apply") == 0
        wait_for("no lag", lambda: value(scrape(port), "applier_lag_bytes") == 0, proc=proc, log=err)
        # WAL of an unpublished table: keepalives carry it, and the daemon records it as applied in commits of
        # progress alone, which are no groups
        published = value(scrape(port), "applier_applied_lsn")
        rig.src("INSERT INTO other (v) SELECT repeat('x', 100) FROM generate_series(1, 2000)")
        idle = scrape_until(port, "a commit of progress alone",
                            lambda m: value(m, "applier_applied_lsn") > published, proc, err)  # type: ignore[operator]
        assert value(idle, "applier_groups_committed_total") == 5  # one source transaction each
        assert value(idle, "applier_group_size_transactions_count") == 5
        assert value(idle, "applier_lag_seconds") == 0
        time.sleep(3)  # idle: the lag of the next transaction is counted from its own commit, not from the last one

        with blocked_target(rig):
            rig.src("INSERT INTO t SELECT g, 'late' FROM generate_series(1001, 1010) g")
            sent = rig.wal_lsn()
            a = scrape_until(port, "lag", lambda m: bool(value(m, "applier_lag_bytes")), proc, err)
            assert value(a, "applier_lag_seconds") < 2.5  # type: ignore[operator]
            time.sleep(1.5)
            b = scrape(port)
            assert rig.tgt("SELECT count(*) FROM t WHERE v = 'late'") == [(0,)]  # still blocked
        assert value(b, "applier_lag_bytes") > 0  # type: ignore[operator]
        assert value(b, "applier_lag_seconds") >= value(a, "applier_lag_seconds") + 1.0  # type: ignore[operator]
        assert value(b, "applier_received_lsn") > value(b, "applier_applied_lsn")  # type: ignore[operator]

        after = scrape_until(port, "the lag back to 0", lambda m: value(m, "applier_lag_bytes") == 0
                             and value(m, "applier_lag_seconds") == 0, proc, err)
        assert rig.tgt("SELECT count(*) FROM t WHERE v = 'late'") == [(10,)]
        assert value(after, "applier_applied_lsn") >= sent - 1024  # type: ignore[operator] # its commit, near
        assert value(after, "applier_rows_written_total", operation="insert", table=table["t"]) == 60
        assert value(after, "applier_transactions_applied_total") == 6
        assert value(after, "applier_groups_committed_total") == 6


def test_a_steady_stream_of_small_transactions_shares_commits(cli_rig: Rig) -> None:
    """Small source transactions committed one after another, half a millisecond apart (a busy OLTP source): a
    target transaction waits a moment (at most 2 ms) for the next source transaction before it commits, so
    several share one commit, and every row arrives."""
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    port = free_port()
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}")
    with daemon(rig, config) as (proc, err):
        wait_for("the metrics endpoint", lambda: scrape(port), proc=proc, log=err)
        # committed by the server itself, half a millisecond apart, whatever the load on the client
        rig.src("DO $$BEGIN FOR i IN 1..300 LOOP INSERT INTO t VALUES (i, 'v'); COMMIT; PERFORM pg_sleep(0.0005); "
                "END LOOP; END$$")
        done = scrape_until(port, "every transaction", lambda m: value(m, "applier_transactions_applied_total") == 300,
                            proc, err)
        assert rig.tgt("SELECT count(*), sum(id) FROM t") == [(300, 300 * 301 // 2)]
        groups = value(done, "applier_groups_committed_total")
        assert groups is not None and groups <= 150, groups  # two source transactions a commit, or more


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_errors_retries_and_reconnects_are_counted(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.tgt("INSERT INTO t VALUES (1, 'local')")  # the source's insert of id 1 fails on it: insert_exists
    port = free_port()
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}", apply_on_error="retry", apply_retry_initial=0.2,
                             apply_retry_max=0.5)
    with daemon(rig, config) as (proc, err):
        rig.src("INSERT INTO t VALUES (1, 'remote')")
        failing = scrape_until(port, "apply errors",
                               lambda m: (value(m, "applier_errors_total", kind="apply") or 0) >= 3, proc, err)
        # each failed session: an apply error, a retry (row by row, then after the backoff) and a new session
        assert value(failing, "applier_retries_total") >= 2  # type: ignore[operator]
        assert value(failing, "applier_reconnects_total") >= 2  # type: ignore[operator]
        assert value(failing, "applier_transactions_applied_total") == 0  # rolled back each time: not counted
        assert value(failing, "applier_lag_bytes") > 0  # type: ignore[operator]
        assert value(failing, "applier_lag_seconds") > 0  # type: ignore[operator]
        rig.tgt("DELETE FROM t WHERE id = 1")
        fixed = scrape_until(port, "the row applied", lambda m: value(m, "applier_transactions_applied_total") == 1,
                             proc, err)
        assert rig.tgt("SELECT v FROM t") == [("remote",)]
        assert value(fixed, "applier_errors_total", kind="connection") == 0
        reconnects = value(fixed, "applier_reconnects_total")
        # the source side of the connection goes: a connection error, and a new session
        rig.src("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])
        lost = scrape_until(port, "a connection error", lambda m: value(m, "applier_errors_total", kind="connection")
                            == 1 and value(m, "applier_reconnects_total") > reconnects, proc, err)  # type: ignore[operator]
        assert value(lost, "applier_errors_total", kind="apply") == value(fixed, "applier_errors_total", kind="apply")
        rig.src("INSERT INTO t VALUES (2, 'after')")
        scrape_until(port, "the next row", lambda m: value(m, "applier_transactions_applied_total") == 2, proc, err)


def test_json_log_lines(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    dsn = f"{rig.source.dsn} password={SECRET}"  # the test servers trust loopback: accepted, ignored
    config = rig.config_file(source_dsn=dsn, apply_heartbeat_interval=1.0)
    with daemon(rig, config, "--log-format", "json") as (proc, err):
        rig.src("INSERT INTO t VALUES (1), (2), (3)")
        wait_for("the rows", lambda: rig.tgt("SELECT count(*) FROM t")[0][0] == 3, proc=proc, log=err)
        rig.tgt("DELETE FROM t WHERE id = 3")
        rig.src("DELETE FROM t WHERE id = 3")
        rig.src("SELECT pg_logical_emit_message(true, %s, 'x')", [f"from {dsn}"])  # source text in a log line
        wait_for("the logged message", lambda: "logical decoding message" in err.read_text(), proc=proc, log=err)
        time.sleep(1.5)  # a heartbeat
    text = err.read_text()
    assert SECRET not in text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    assert lines and all({"timestamp", "level", "logger", "message"} <= set(x) for x in lines), lines
    assert all(x["timestamp"].endswith("Z") and x["timestamp"][10] == "T" for x in lines)
    missing = [x for x in lines if x.get("conflict") == "delete_missing"]
    assert len(missing) == 1, lines
    m = missing[0]
    assert m["level"] == "WARNING" and m["operation"] == "DELETE"
    assert m["table"] == ("public.t" if rig.kind == "postgresql" else "t")
    assert m["lsn"] in m["message"] and "/" in m["lsn"]
    logged = [x for x in lines if "logical decoding message" in x["message"]]
    assert len(logged) == 1 and "password=***" in logged[0]["message"] and isinstance(logged[0]["xid"], int)
    assert any(x["message"].startswith("heartbeat:") and "lsn" in x for x in lines), lines


def test_text_log_lines_are_redacted_too(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    rig.src("SELECT pg_logical_emit_message(true, %s, 'x')", [f"postgresql://app:{SECRET}@db/app"])
    r = run_cli("catchup", "-c", str(rig.config_file()))
    assert r.returncode == 0, r.stderr
    assert "logical decoding message" in r.stderr and "postgresql://app:***@db/app" in r.stderr
    assert SECRET not in r.stderr + r.stdout


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_bad_metrics_and_log_settings_stop_before_anything_is_applied(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1)")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases: list[tuple[list[str], dict[str, Any], list[str]]] = [
            (["--metrics", f"127.0.0.1:{port}"], {}, ["option --metrics", f"127.0.0.1:{port}", "already in use"]),
            ([], {"metrics_listen": f"127.0.0.1:{port}"}, ["metrics.listen", f"127.0.0.1:{port}", "already in use"]),
            (["--metrics", "localhost"], {}, ["option --metrics", "HOST:PORT", "'localhost'"]),
            ([], {"metrics_listen": "127.0.0.1:99999"}, ["metrics.listen", "HOST:PORT", "'127.0.0.1:99999'"]),
            ([], {"metrics_listen": ":9187"}, ["metrics.listen", "':9187'"]),
            (["--log-format", "xml"], {}, ["option --log-format", "text, json", "'xml'"]),
            ([], {"log_format": "yaml"}, ["log.format", "text, json", "'yaml'"]),
        ]
        for i, (args, keys, words) in enumerate(cases):
            config = rig.config_file(f"bad{i}.toml", **keys)
            for command in ("run", "catchup"):
                r = run_cli(command, "-c", str(config), *args, timeout=60)
                assert r.returncode == 2, (args, keys, r.stderr)
                lines = r.stderr.splitlines()
                assert len(lines) == 1 and lines[0].startswith("applier: error: "), r.stderr
                assert all(w in lines[0] for w in words), (words, lines[0])
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]  # nothing applied
    assert rig.progress_lsn() == 0


def test_the_dashboard_shows_every_metric_and_only_those() -> None:
    dashboard = Path(__file__).resolve().parents[3] / "contrib" / "grafana" / "applier.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
    used = set(re.findall(r"\bapplier_[a-z_]+", " ".join(exprs)))
    families = {fam.name: fam.type for fam in Metrics().registry.collect()}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    served = {name + suffix for name, kind in families.items() for suffix in suffixes[kind]}
    assert used <= served, used - served
    assert {name for name in families if not any(name + x in used for x in suffixes[families[name]])} == set()


def test_spool_bytes_and_prepared_transactions_waiting(cli_rig: Rig) -> None:
    """A streamed transaction still open at the source shows its spooled bytes, gone once it commits; a prepared
    transaction applied up to PREPARE counts as waiting until COMMIT PREPARED (target PREPARE TRANSACTION on
    PostgreSQL, applier_prepared on SQLite)."""
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    extra = {"source_streaming": True, "source_two_phase": True}
    rig.init(**extra)
    port = free_port()
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}", source_status_interval=0.5, **extra)
    with daemon(rig, config) as (proc, err):
        first = wait_for("the metrics endpoint", lambda: scrape(port), proc=proc, log=err)
        assert value(first, "applier_spool_bytes") == 0
        assert value(first, "applier_prepared_transactions_waiting") == 0
        with psycopg.connect(rig.source.dsn) as conn:  # past logical_decoding_work_mem (64kB): streamed while open
            conn.execute("INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1, 2000) g")
            scrape_until(port, "the open transaction's spool", lambda m: value(m, "applier_spool_bytes") > 200_000,
                         proc, err)  # type: ignore[operator]
            assert rig.tgt("SELECT count(*) FROM t") == [(0,)]
        scrape_until(port, "the spool emptied", lambda m: value(m, "applier_spool_bytes") == 0, proc, err)
        wait_for("the streamed rows", lambda: rig.tgt("SELECT count(*) FROM t") == [(2000,)], proc=proc, log=err)
        with psycopg.connect(rig.source.dsn, autocommit=True) as conn:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (5000, 'prepared')")
            conn.execute("PREPARE TRANSACTION 'applier_metrics_gx'")
            scrape_until(port, "one prepared transaction waiting",
                         lambda m: value(m, "applier_prepared_transactions_waiting") == 1, proc, err)
            conn.execute("COMMIT PREPARED 'applier_metrics_gx'")
        scrape_until(port, "none waiting", lambda m: value(m, "applier_prepared_transactions_waiting") == 0, proc, err)
        wait_for("the prepared row", lambda: rig.tgt("SELECT v FROM t WHERE id = 5000") == [("prepared",)],
                 proc=proc, log=err)
