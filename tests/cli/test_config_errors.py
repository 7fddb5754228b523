"""A wrong configuration, as a user meets it: the installed ``applier`` script, real servers.

Each mistake gives exit code 2 (3: a database that cannot be reached) and exactly one line on stderr (``applier: error: …``)
that names the key or the object at fault, before anything is touched: no slot
is created, no target file or control table appears. Every DSN carries
``password=sekret`` (the test servers trust loopback, so it is accepted and
ignored); it must never be printed. Environment variables override the file.

The commands are independent, so they run concurrently (each start of the
script costs about a second); each case is then its own test.
"""

from __future__ import annotations

import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from applier.sandbox.clusters import find_install
from tests.plugins.cli import run_cli
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db

SECRET = "sekret"


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env)


def toml(sections: dict[str, dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)

    return "\n".join(f"[{s}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items()) for s, body in sections.items())


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Case:
    """One command with one mistake, and the words its error line must contain."""

    args: list[str]
    names: list[str]
    env: dict[str, str] = field(default_factory=dict)
    target_file: Path | None = None  # must not exist afterwards
    result: subprocess.CompletedProcess[str] | None = None


@dataclass
class World:
    source: ScratchDb
    target: ScratchDb
    tmp: Path
    cases: dict[str, Case]
    env_case: Case
    env_target: Path
    slots_after: set[str]


@pytest.fixture(scope="module")
def world(pg_clusters: ClusterPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """Set up the source, write one config per mistake, run every command (concurrently)."""
    install = find_install()
    tmp = tmp_path_factory.mktemp("config-errors")
    with scratch_db(pg_clusters.get(install, "source"), "src") as source, \
            scratch_db(pg_clusters.get(install, "target"), "tgt") as target:
        c, db = source.cluster, source.dbname
        c.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t", db)
        c.execute("SELECT pg_create_logical_replication_slot('ready', 'pgoutput')", db)
        c.execute("DO $$ BEGIN CREATE ROLE noreplication LOGIN; "
                  "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        try:
            yield _run_world(source, target, tmp)
        finally:
            c.execute("DROP ROLE IF EXISTS noreplication")


def _run_world(source: ScratchDb, target: ScratchDb, tmp: Path) -> World:
    dsn = f"{source.dsn} password={SECRET}"
    port = closed_port()
    good = {"dsn": dsn, "slot": "ready", "publications": ["pub"]}
    cases: dict[str, Case] = {}

    def case(name: str, sections: dict[str, dict[str, Any]] | None, command: list[str], names: list[str],
             env: dict[str, str] | None = None, target_file: bool = True) -> None:
        path = tmp / f"{name}.toml"
        tfile = tmp / f"{name}.db"
        if sections is not None:
            sections.setdefault("target", {}).setdefault("url", f"sqlite:///{tfile}")
            path.write_text(toml(sections))
        cases[name] = Case([*command, "-c", str(path)], names, env or {}, tfile if target_file else None)

    case("missing_key", {"source": {"slot": "ready"}}, ["init"], ["source.dsn", "APPLIER_SOURCE_DSN"])
    case("unknown_key", {"source": {**good, "slots": "x"}}, ["init"], ["source.slots"])
    case("unknown_section", {"source": good, "sources": {"dsn": dsn}}, ["init"], ["[sources]"])
    case("wrong_type", {"source": good, "apply": {"retry_max": "soon"}}, ["catchup"], ["apply.retry_max", "float"])
    case("bad_target_url", {"source": good, "target": {"url": "replica.db"}}, ["init"], ["target.url"])
    case("bad_target_scheme", {"source": good, "target": {"url": f"mysql://root:{SECRET}@127.0.0.1/db"}},
         ["init"], ["target.url", "mysql"])
    case("unreachable_source", {"source": {**good, "dsn": f"host=127.0.0.1 port={port} dbname=app password={SECRET}"}},
         ["init"], ["source.dsn", "cannot connect", str(port)])
    case("unreachable_source_uri", {"source": {**good, "dsn": f"postgresql://postgres:{SECRET}@127.0.0.1:{port}/app"}},
         ["catchup"], ["source.dsn", "cannot connect", str(port)])
    case("missing_publication", {"source": {**good, "publications": ["pub", "nope"]}}, ["init"],
         ["source.publications", "'nope'", "does not exist"])
    case("missing_slot_catchup", {"source": {**good, "slot": "nosuch"}}, ["catchup"], ["source.slot", "'nosuch'"])
    case("missing_slot_run", {"source": {**good, "slot": "nosuch"}}, ["run"], ["source.slot", "'nosuch'"])
    case("no_replication_privilege",
         {"source": {**good, "slot": "would_be_new",
                     "dsn": f"host=127.0.0.1 port={source.cluster.port} dbname={source.dbname} user=noreplication "
                            f"password={SECRET}"}},
         ["init"], ["source.dsn", "REPLICATION"])
    case("target_not_initialized_sqlite", {"source": good}, ["catchup"], ["target.url", "applier init"])
    case("target_not_initialized_pg", {"source": good, "target": {"url": target.url}}, ["status"],
         ["target.url", "applier init"], target_file=False)
    case("bad_lsn", {"source": good}, ["skip", "--lsn", "16/zz"], ["--lsn", "'16/zz'"])

    # environment overrides: the file's source is unreachable and its target elsewhere; the environment wins
    env_target = tmp / "from_env.db"
    file_target = tmp / "from_file.db"
    env_cfg = tmp / "env.toml"
    env_cfg.write_text(toml({"source": {"dsn": f"host=127.0.0.1 port={port} dbname=app", "slot": "from_env",
                                        "publications": ["pub"]},
                             "target": {"url": f"sqlite:///{file_target}"}}))
    env_case = Case(["init", "-c", str(env_cfg)], [], {"APPLIER_SOURCE_DSN": dsn,
                                                        "APPLIER_TARGET_URL": f"sqlite:///{env_target}"}, file_target)

    everything = [*cases.values(), env_case]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for c, result in zip(everything, pool.map(lambda c: run(c.args, c.env), everything)):
            c.result = result
    slots = {r[0] for r in source.cluster.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s",
                                                  params=[source.dbname])}
    return World(source, target, tmp, cases, env_case, env_target, slots)


CASES = ["missing_key", "unknown_key", "unknown_section", "wrong_type", "bad_target_url", "bad_target_scheme",
         "unreachable_source", "unreachable_source_uri", "missing_publication", "missing_slot_catchup",
         "missing_slot_run", "no_replication_privilege", "target_not_initialized_sqlite", "target_not_initialized_pg",
         "bad_lsn"]


@pytest.mark.parametrize("name", CASES)
def test_one_clear_line_and_nothing_touched(world: World, name: str) -> None:
    case = world.cases[name]
    r = case.result
    assert r is not None
    assert r.returncode == (3 if name.startswith("unreachable") else 2), (r.stdout, r.stderr)  # 3: connection
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("applier: error: ") and "Traceback" not in line
    for word in case.names:
        assert word in line, line
    assert SECRET not in r.stdout + r.stderr
    if case.target_file is not None:
        assert not case.target_file.exists(), f"{name} created the target file"


def test_cases_are_all_checked(world: World) -> None:
    assert set(world.cases) == set(CASES)


def test_no_slot_created_and_no_control_tables_on_errors(world: World) -> None:
    assert world.slots_after == {"ready", "from_env"}  # only the environment-override init made one
    tables = world.target.cluster.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE 'applier%'",
                                          world.target.dbname)
    assert tables == []


def test_environment_overrides_the_file(world: World) -> None:
    r = world.env_case.result
    assert r is not None and r.returncode == 0, r.stderr
    assert "slot 'from_env': created at" in r.stdout
    assert SECRET not in r.stdout + r.stderr
    assert not world.env_case.target_file.exists()  # the file's target was not used
    with sqlite3.connect(world.env_target) as db:
        assert db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'applier_progress'").fetchone() == (1,)
