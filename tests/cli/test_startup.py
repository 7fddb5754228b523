"""``applier catchup`` starts without the heavy libraries (issue 14): structure, not timing.

typer (and, from typer 0.29, the pydantic validators it builds for every option), SQLAlchemy, alembic and rich
cost a few tenths of a second to import; the apply commands need none of them. The first test runs
a real ``applier catchup`` (the script's entry point, a real source, a SQLite or PostgreSQL target,
one row to apply) in a subprocess that lists the modules it imported, and checks the row arrived
and none of those were imported. The second counts the sessions a real catch-up with nothing to apply opens on
each database (``pg_stat_database.sessions``): the start-up checks read on the connections the command keeps
anyway. bench/startup.py measures the time itself.

The typer-free way in (``applier.cli.apply_command``) must read a command line as typer does, or hand it
to typer: the other tests pin both.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main

from applier.admin import init
from applier.cli import apply_command
from applier.cli.app import app
from applier.config import load_config
from applier.sandbox.clusters import find_install
from tests.plugins.cli import PROBE, clean_env
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db

HEAVY = ("typer", "click", "pydantic", "pydantic_core", "sqlalchemy", "alembic", "rich")
# what only some catch-ups use, loaded when asked: the DDL model and its follower (apply.schema_changes "follow"), the
# binary converters (source.binary), verify's read plans; sqlite3 (a SQLite target)
UNUSED = ("applier.ddl", "applier.engine.ddl", "applier.targets.binary", "applier.migrate")



@pytest.fixture(scope="module")
def source(pg_clusters: ClusterPool) -> Iterator[ScratchDb]:
    with scratch_db(pg_clusters.get(find_install(), "source"), "src") as db:
        db.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION pub FOR TABLE t",
                           db.dbname)
        yield db


@pytest.fixture(scope="module")
def pg_target_db(pg_clusters: ClusterPool) -> Iterator[ScratchDb]:
    with scratch_db(pg_clusters.get(find_install(), "target"), "tgt") as db:
        yield db


def prepare(source: ScratchDb, pg_target_db: ScratchDb, tmp_path: Path, kind: str, slot: str) -> tuple[Path, str]:
    """A config for a fresh slot and a target of ``kind``, initialized; its path and the target's URL."""
    source.cluster.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", source.dbname, [slot])
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'replica.db'}"
        with sqlite3.connect(tmp_path / "replica.db") as db:
            db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        db.close()
    else:
        url = pg_target_db.url
        pg_target_db.cluster.execute("CREATE TABLE IF NOT EXISTS t (id int PRIMARY KEY, v text)", pg_target_db.dbname)
    config = tmp_path / "applier.toml"
    config.write_text(f'[source]\ndsn = "{source.dsn}"\nslot = "{slot}"\npublications = ["pub"]\n\n'
                      f'[target]\nurl = "{url}"\n\n[apply]\nname = "{slot}"\nwork_dir = "{tmp_path / "work"}"\n')
    init(load_config(config, env={}))
    return config, url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_catchup_imports_no_heavy_library(source: ScratchDb, pg_target_db: ScratchDb, tmp_path: Path,
                                          kind: str) -> None:
    config, _ = prepare(source, pg_target_db, tmp_path, kind, f"startup_{kind}")
    row = (1 if kind == "sqlite" else 2, kind)  # one source table for both: the slot made here sees only this row
    source.cluster.execute("INSERT INTO t VALUES (%s, %s)", source.dbname, list(row))

    modules = tmp_path / "modules.txt"
    r = subprocess.run([sys.executable, "-c", PROBE, str(modules), "catchup", "-c", str(config)],
                       capture_output=True, text=True, timeout=120, env=clean_env(), stdin=subprocess.DEVNULL)

    assert r.returncode == 0, r.stderr
    assert "applied 1 transactions, 1 rows" in r.stdout
    if kind == "sqlite":
        with sqlite3.connect(tmp_path / "replica.db") as db:
            rows = db.execute("SELECT id, v FROM t").fetchall()
        db.close()
    else:
        rows = pg_target_db.cluster.execute("SELECT id, v FROM t WHERE v = %s", pg_target_db.dbname, [kind])
    assert rows == [row]
    loaded = set(modules.read_text().split())
    assert {"psycopg", "applier.engine.runner"} <= loaded  # the list is the real one
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []
    unused = (*UNUSED, "sqlite3") if kind == "postgresql" else UNUSED
    assert sorted(m for m in loaded if any(m == u or m.startswith(u + ".") for u in unused)) == []


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_catchup_connects_to_each_database_as_few_times_as_it_can(source: ScratchDb, pg_target_db: ScratchDb,
                                                                  tmp_path: Path, kind: str) -> None:
    """What a one-shot catch-up with nothing to apply costs the servers: besides its replication connection, one
    session on the source (the checks, then the goal) and, on a PostgreSQL target, two (the checks', on which the
    claim is then taken, and the session's that applies), as an operator counts them in pg_stat_database."""
    config, _ = prepare(source, pg_target_db, tmp_path, kind, f"conns_{kind}")
    before = source.sessions(), pg_target_db.sessions()

    r = subprocess.run([sys.executable, "-c", "from applier.cli.main import main; main()", "catchup", "-c",
                        str(config)], capture_output=True, text=True, timeout=120, env=clean_env(),
                       stdin=subprocess.DEVNULL)

    assert r.returncode == 0, r.stderr
    assert "applied 0 transactions" in r.stdout
    after = source.sessions(), pg_target_db.sessions()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 2 if kind == "postgresql" else 0)


@pytest.mark.parametrize("argv", [
    ["catchup", "--help"], ["--help"], ["status", "-c", "x.toml"], ["catchup", "--bogus", "1"], ["catchup", "-c"],
    ["catchup", "-c=x.toml"], ["catchup", "-cx.toml"], ["catchup", "-c", "a.toml", "-c", "b.toml"],
    ["catchup", "-c", ""], ["catchup", "--config="], ["catchup", "--dsn", "-x"], ["catchup", "-c", "x", "--"],
    ["catchup", "extra"], ["catchup", "-c", "x.toml", "-v"], ["-v", "-v", "catchup"], ["-x", "catchup"], [],
])
def test_other_command_lines_go_to_typer(argv: list[str]) -> None:
    assert apply_command.parse(argv) is None


def test_plain_apply_command_lines_are_read_as_typer_reads_them() -> None:
    assert apply_command.parse(["catchup"]) == apply_command.Call(False, True, {})
    assert apply_command.parse(["-v", "run", "--config=a.toml", "--dsn", "host=h dbname=d", "-p", "p1",
                        "--publication=p2", "--slot", "s", "--target", "sqlite:///r.db"]) == apply_command.Call(
        True, False, {"config": Path("a.toml"), "dsn": "host=h dbname=d", "publication": ["p1", "p2"], "slot": "s",
                      "target": "sqlite:///r.db"})
    assert apply_command.parse(["--verbose", "catchup", "-c", "a.toml"]) == apply_command.Call(True, True, {"config": Path("a.toml")})
    assert apply_command.parse(["catchup", "--until", "0/1"]) == apply_command.Call(False, True, {"until": "0/1"})
    assert apply_command.parse(["run", "--until", "0/1"]) is None  # catchup's alone: typer refuses it for run


@pytest.mark.parametrize("command", apply_command.COMMANDS)
def test_the_typer_free_options_are_the_typer_commands_options(command: str) -> None:
    group = typer.main.get_command(app)
    cmd = group.commands[command]  # type: ignore[attr-defined]
    typer_options = {opt: p.name for p in cmd.params for opt in p.opts}
    assert typer_options == (apply_command.CATCHUP_OPTIONS if command == "catchup" else apply_command.OPTIONS)
    # (--version is typer's alone: a command line with it is not a plain catchup/run line)
    assert {opt for p in group.params for opt in p.opts} - {"--version"} == set(apply_command.VERBOSE)
    assert apply_command.parse(["--version", command]) is None
