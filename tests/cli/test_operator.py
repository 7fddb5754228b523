"""The command line as an operator meets it (issue 25): passwords never printed, one line instead of a traceback,
the exit code of each kind of outcome, and the small things people expect (``-h``, ``postgres://``, quoted hints).

Real servers (PostgreSQL 15, the session's source and target clusters), real SQLite files, the installed
``applier`` script. Every DSN and URL carries ``SECRET`` as its password (the test servers trust loopback, so it
is accepted and ignored); it must never appear in what a command prints, whatever the command, the DSN's form or
the logging (``-v``, ``--log-format json``).
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.sandbox.clusters import find_install
from tests.cli.test_config_errors import closed_port
from tests.plugins.cli import ctrl_c, foreground, invoke, popen, run_cli, write_toml
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db

SECRET = "Sup3rSecret"


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed ``applier`` with ``args``; APPLIER_* variables of the test run not passed on."""
    return run_cli(*args, env=env, timeout=timeout)


def run_a_while(*args: str, env: dict[str, str] | None = None, seconds: float = 4) -> subprocess.CompletedProcess[str]:
    """``run`` with ``args`` (a daemon, which may wait for a database): stopped by SIGTERM after ``seconds`` if it
    is still running; what it printed."""
    proc = popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The single ``applier: error:`` line a failed command printed (its last line), with no traceback anywhere."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("applier: error: ")]
    assert len(errors) == 1 and r.stderr.splitlines()[-1] == errors[0], r.stderr
    return errors[0]


@dataclass
class World:
    source: ScratchDb
    target: ScratchDb
    tmp: Path

    def config(self, name: str, source: dict[str, Any] | None = None, target: str | None = None,
               **sections: dict[str, Any]) -> Path:
        """A config file: the good source (slot ``s``, publication ``pub``) and a SQLite target of its own, with
        ``source`` keys and ``target`` URL replaced."""
        body = {"source": {"dsn": f"{self.source.dsn} password={SECRET}", "slot": "s", "publications": ["pub"],
                           **(source or {})},
                "target": {"url": target or f"sqlite:///{self.tmp / name}.db"}, **sections}
        body["apply"] = {"work_dir": str(self.tmp / "work"), **sections.get("apply", {})}
        return write_toml(self.tmp / f"{name}.toml", body)

    def src(self, sql: str) -> list[tuple[Any, ...]]:
        return self.source.cluster.execute(sql, self.source.dbname)


@pytest.fixture(scope="module")
def world(pg_clusters: ClusterPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    install = find_install()
    with scratch_db(pg_clusters.get(install, "source"), "src") as source, \
            scratch_db(pg_clusters.get(install, "target"), "tgt") as target:
        source.cluster.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t",
                               source.dbname)
        yield World(source, target, tmp_path_factory.mktemp("operator"))


# -- passwords ------------------------------------------------------------------------------------------------------

COMMANDS = [["init"], ["catchup"], ["run"], ["status"], ["status", "--json"], ["skip", "--lsn", "0/1"],
            ["conflicts"], ["decode", "--peek"], ["record", "-o", "{tmp}/r.rec"], ["sync"], ["verify"], ["cutover"],
            ["-v", "catchup"], ["-v", "status"], ["-v", "init"], ["catchup", "--log-format", "json"], ["repair"],
            ["resync"]]


def test_sync_and_verify_refused_by_their_checks_start_no_spark(world: World) -> None:
    """A source that cannot be reached: the one line and nothing before it (a JVM started meanwhile would print its
    own start-up lines, and cost its start)."""
    dsn = f"host=127.0.0.1 port={closed_port()} dbname=app user=app connect_timeout=2"
    for command, target in (("verify", None), ("sync", world.target.url)):
        done = run(command, "-c", str(world.config(f"nospark-{command}", {"dsn": dsn}, target=target)))
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, (command, done.stderr)
        assert "cannot" in done.stderr or "could not" in done.stderr or "refused" in done.stderr, done.stderr


def test_no_password_is_printed_by_any_command_in_any_dsn_form(world: World) -> None:
    port = closed_port()
    forms = {
        "key=value": f"host=127.0.0.1 port={port} dbname=app user=app password={SECRET}",
        "uri": f"postgresql://app:{SECRET}@127.0.0.1:{port}/app?sslmode=disable",
        "uri-bad": f"postgresql://app:{SECRET}%zz@127.0.0.1:{port}/app",  # libpq cannot read it
        "typo": f"host=127.0.0.1 port={port} dbname=app passwd={SECRET}",  # not a libpq keyword
        "no-equals": f"host=127.0.0.1 port={port} password {SECRET}",
    }
    runs: list[tuple[str, list[str], dict[str, str]]] = []
    for f, (form, dsn) in enumerate(forms.items()):
        for i, command in enumerate(COMMANDS):
            if (i + f) % 2:  # each command in half the forms, each form with half the commands (time)
                continue
            args = [a.replace("{tmp}", str(world.tmp)) for a in command]
            if i % 4 < 2:  # from the file
                runs.append((form, [*args, "-c", str(world.config(f"pw-{form}-{i}", {"dsn": dsn}))], {}))
            else:  # from the environment, over a good file
                runs.append((form, [*args, "-c", str(world.config(f"pw-{form}-{i}"))], {"APPLIER_SOURCE_DSN": dsn}))
    # the target's password: unreachable, and in a SQLAlchemy URL
    for command in (["init"], ["catchup"], ["status", "--json"], ["-v", "status"], ["skip", "--lsn", "0/1"]):
        target = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:{port}/app"
        runs.append(("target", [*command, "-c", str(world.config("pw-target", target=target))], {}))
        runs.append(("target-env", [*command, "-c", str(world.config("pw-target-env"))],
                     {"APPLIER_TARGET_URL": f"postgres://app:{SECRET}@127.0.0.1:{port}/app"}))
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda r: run_a_while(*r[1], env=r[2]) if "run" in r[1] else run(*r[1], env=r[2]),
                                runs))
    leaked = [(form, args, r.stdout + r.stderr) for (form, args, _), r in zip(runs, results, strict=True)
              if SECRET in r.stdout + r.stderr]
    assert not leaked, leaked[:3]
    # every one met its error path: `run` waits for a source it cannot reach, saying so, until stopped
    failed = [(form, args, r.returncode) for (form, args, _), r in zip(runs, results, strict=True)
              if r.returncode == 0 and not ("run" in args and "retrying in" in r.stderr)]
    assert not failed, failed
    typo = [r.stderr for (form, args, _), r in zip(runs, results, strict=True) if form == "typo"]
    assert any("libpq cannot read the DSN (host=*** port=*** dbname=*** passwd=***)" in err for err in typo), typo


# -- exit codes -----------------------------------------------------------------------------------------------------

def test_exit_codes_by_kind(world: World) -> None:
    port = closed_port()
    good = world.config("codes")
    assert run("init", "-c", str(good)).returncode == 0
    with sqlite3.connect(world.tmp / "codes.db") as db:
        db.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    world.src("INSERT INTO t VALUES (1)")
    r = run("catchup", "-c", str(good))
    assert r.returncode == 0, r.stderr
    assert run("status", "-c", str(good)).returncode == 0

    # 2: configuration
    bad = world.config("codes-bad", apply={"retry_initial": -1.0})
    for command in ("init", "catchup", "status", "run"):
        r = run(command, "-c", str(bad))
        assert r.returncode == 2, (command, r.stderr)
        assert "apply.retry_initial" in one_error_line(r)

    # 2: a DSN libpq cannot read is configuration, never waited for (`run` waits only for a database)
    unreadable = world.config("codes-unreadable", {"dsn": f"host=127.0.0.1 dbname=app passwd={SECRET}"})
    for command in ("catchup", "run"):
        r = run(command, "-c", str(unreadable), timeout=60)
        assert r.returncode == 2, (command, r.stderr)
        assert "source.dsn: libpq cannot read the DSN" in one_error_line(r) and SECRET not in r.stderr

    # 3: a database cannot be reached
    no_source = world.config("codes-no-source", {"dsn": f"host=127.0.0.1 port={port} dbname=app password={SECRET}"},
                             target=f"sqlite:///{world.tmp / 'codes.db'}")
    no_target = world.config("codes-no-target", target=f"postgresql://app@127.0.0.1:{port}/app")
    for command in ("init", "catchup", "status"):
        for config in (no_source, no_target):
            r = run(command, "-c", str(config))
            assert r.returncode == 3, (command, config, r.stderr)
            assert "cannot" in one_error_line(r)

    # status --json with the source down: what the target says, and the error
    r = run("status", "--json", "-c", str(no_source))
    assert r.returncode == 3, r.stderr
    info = json.loads(r.stdout)
    assert info["applied_lsn"] != "0/0" and "cannot connect to the source" in info["error"], info
    assert info["slot_exists"] is None
    r = run("status", "--json", "-c", str(no_target))
    assert r.returncode == 3, r.stderr
    info = json.loads(r.stdout)
    assert info["name"] == "applier" and "cannot open the target" in info["error"], info

    # 5: refused: the claim is held by a running applier
    daemon = popen(["run", "-c", str(good)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # waited for with `status` in this process (no Python start per look: the wait is not the point)
        while "running: applier run" not in invoke("status", "-c", str(good)).stdout:
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr
            time.sleep(0.3)
        for command in ("catchup", "run"):
            r = run(command, "-c", str(good))
            assert r.returncode == 5, (command, r.stderr)
            assert "applier run" in one_error_line(r)
        # 130: SIGINT (Ctrl-C) stops the daemon as SIGTERM does, with its summary, but says it was interrupted
        daemon.send_signal(signal.SIGINT)
        out, err = daemon.communicate(timeout=60)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert daemon.returncode == 130, err
    assert err.rstrip().splitlines()[-1] == "applier: interrupted" and "Traceback" not in err, err
    assert out.strip(), "no summary line"

    # 6: the slot is gone
    world.src("SELECT pg_drop_replication_slot('s')")
    for args in (["status"], ["status", "--json"]):
        r = run(*args, "-c", str(good))
        assert r.returncode == 6, (args, r.stderr)
        assert "'s' does not exist" in one_error_line(r)


def test_an_interrupted_typer_command_is_one_line_and_130(world: World) -> None:
    config = world.config("interrupt", {"slot": "interrupt"})
    world.src("SELECT pg_create_logical_replication_slot('interrupt', 'pgoutput')")
    proc = popen(["record", "-c", str(config), "-o", str(world.tmp / "i.rec"), "--until-lsn", "FFFFFFFF/0",
                 "--idle-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not world.src("SELECT 1 FROM pg_replication_slots WHERE slot_name = 'interrupt' AND active"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err == "applier: interrupted\n", err


# -- tracebacks and URLs --------------------------------------------------------------------------------------------

def test_sqlite_urls_that_name_no_file_are_refused_by_every_command(world: World) -> None:
    for url, words in (("sqlite://r.db", ["sqlite:///r.db", "three slashes"]),
                       ("sqlite://", ["in-memory"]), ("sqlite:///:memory:", ["in-memory"])):
        for command in ("init", "catchup", "status", "run"):
            r = run(command, "-c", str(world.config("sqlite-url")), env={"APPLIER_TARGET_URL": url})
            assert r.returncode == 2, (url, command, r.stderr)
            line = one_error_line(r)
            assert "APPLIER_TARGET_URL" in line and "applier init" not in line, line
            for word in words:
                assert word in line, line
    assert not world.src("SELECT 1 FROM pg_replication_slots WHERE slot_name = 's-none'")


def test_a_sqlite_file_that_cannot_be_opened_names_its_directory(world: World) -> None:
    missing = world.tmp / "no-such-dir"
    r = run("init", "-c", str(world.config("nodir", {"slot": "nodir"}, target=f"sqlite:///{missing}/r.db")))
    assert r.returncode == 3, r.stderr
    assert f"the directory {missing} does not exist" in one_error_line(r)
    assert not world.src("SELECT 1 FROM pg_replication_slots WHERE slot_name = 'nodir'")


def test_record_into_a_missing_directory_is_one_line(world: World) -> None:
    out = world.tmp / "missing-dir" / "s.rec"
    r = run("record", "-c", str(world.config("rec")), "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert f"the directory {out.parent} does not exist" in one_error_line(r)


def test_a_postgres_url_is_a_target_url(world: World) -> None:
    with scratch_db(world.target.cluster, "pgurl") as target:
        url = f"postgres://postgres@127.0.0.1:{target.cluster.port}/{target.dbname}"
        config = world.config("pgurl", {"slot": "pgurl"}, target=url)
        r = run("init", "-c", str(config))
        assert r.returncode == 0, r.stderr
        world.src("INSERT INTO t VALUES (2) ON CONFLICT DO NOTHING")
        target.cluster.execute("CREATE TABLE t (id int PRIMARY KEY)", target.dbname)
        r = run("catchup", "-c", str(config))
        assert r.returncode == 0, r.stderr
        assert (2,) in target.cluster.execute("SELECT id FROM t", target.dbname)
        world.src("SELECT pg_drop_replication_slot('pgurl')")


# -- the small ones -------------------------------------------------------------------------------------------------

def test_skip_refuses_a_position_past_the_wal_and_says_what_it_replaces(world: World) -> None:
    config = world.config("skip", {"slot": "skip"})
    assert run("init", "-c", str(config)).returncode == 0
    r = run("skip", "-c", str(config), "--lsn", "FFFFFFFF/FFFFFFFF")
    assert r.returncode == 2
    assert "source's WAL is at" in one_error_line(r)
    wal = world.src("SELECT pg_current_wal_lsn()::text")[0][0]
    r = run("skip", "-c", str(config), "--lsn", wal)
    assert r.returncode == 0 and "replaces" not in r.stdout, r.stderr
    world.src("INSERT INTO t VALUES (3) ON CONFLICT DO NOTHING")
    newer = world.src("SELECT pg_current_wal_lsn()::text")[0][0]
    r = run("skip", "-c", str(config), "--lsn", newer)
    assert r.returncode == 0, r.stderr
    assert f"replaces the pending skip of the transaction finished at {wal}" in r.stdout
    with sqlite3.connect(world.tmp / "skip.db") as db:
        assert db.execute("SELECT skip_lsn FROM applier_progress").fetchone() == (newer,)
    world.src("SELECT pg_drop_replication_slot('skip')")


def test_help_with_h_on_every_command_and_the_exit_codes_in_the_root_help() -> None:
    r = run("--help")
    assert r.returncode == 0
    for code in ("0", "1", "2", "3", "4", "5", "6", "130"):
        assert f" {code}  " in r.stdout, r.stdout
    commands = ["init", "catchup", "run", "status", "conflicts", "skip", "demo", "sync", "verify", "cutover",
                "decode", "record", "repair", "resync"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda c: run(c, "-h"), commands))
    for command, r in zip(commands, results, strict=True):
        assert r.returncode == 0 and "Usage: applier " + command in " ".join(r.stdout.split()), (command, r.stderr)


def test_a_hint_that_prints_a_command_is_shell_quoted(world: World) -> None:
    world.src('CREATE SCHEMA "my schema"; CREATE TABLE "my schema"."tab le" (id int PRIMARY KEY); '
              'ALTER PUBLICATION pub ADD TABLE "my schema"."tab le"')
    try:
        config = world.config("hint", {"slot": "hint"})
        assert run("init", "-c", str(config)).returncode == 0
        world.src('INSERT INTO "my schema"."tab le" VALUES (1)')
        r = run("catchup", "-c", str(config))
        assert r.returncode == 4, r.stderr
        assert "applier sync --table 'my schema.tab le'" in one_error_line(r)
    finally:
        world.src('ALTER PUBLICATION pub DROP TABLE "my schema"."tab le"')
        world.src("SELECT pg_drop_replication_slot('hint')")


@pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java")
@pytest.mark.parametrize("rows", [1000, 300000], ids=["by-the-command", "by-spark"])
def test_ctrl_c_during_a_copy_is_one_line_and_130(world: World, rows: int) -> None:
    """Ctrl-C reaches the whole foreground process group (the JVM too) while the command (a small table: it copies
    it itself) or a Spark task (more than DRIVER_PAGES, on local[4]: two copy streams) copies into a table the test holds locked: one line, exit 130,
    no py4j log line or traceback, and the slot of the copy dropped."""
    pytest.importorskip("pyspark")
    big = f"big{rows}"  # the world is the module's: a table, publication and slot of each test's own
    world.src(f"CREATE TABLE {big} (id int PRIMARY KEY); INSERT INTO {big} SELECT generate_series(1, {rows}); "
              f"CREATE PUBLICATION {big}pub FOR TABLE {big}")
    with scratch_db(world.target.cluster, "ctrlc") as target:
        target.cluster.execute(f"CREATE TABLE {big} (id int PRIMARY KEY)", target.dbname)
        config = world.config(f"ctrlc{rows}", {"slot": f"ctrlc{rows}", "publications": [f"{big}pub"]}, target=target.url,
                              spark={"master": "local[4]", "partitions": 1})
        with psycopg.connect(target.dsn) as lock:
            lock.execute(f"LOCK TABLE {big} IN EXCLUSIVE MODE")  # reads go on, the copy's writes wait
            with foreground("sync", "-q", "-c", str(config)) as proc:
                deadline = time.monotonic() + 180
                while not target.cluster.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock' "
                        "AND query LIKE 'COPY%%'", params=[target.dbname]):
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "the copy did not wait on the lock"
                    time.sleep(0.5)
                out, err = ctrl_c(proc)
            lock.rollback()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "ERROR" not in err and "py4j" not in err, err
    assert err.rstrip().splitlines()[-1] == "applier: interrupted", err
    assert not world.src(f"SELECT 1 FROM pg_replication_slots WHERE slot_name = 'ctrlc{rows}'")
