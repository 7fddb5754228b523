"""Fixtures for the apply engine's end-to-end tests: a target of either kind, configs, the daemon.

``target`` is parametrized indirectly with ``"pg"`` or ``"sqlite"``: a fresh
database on the session's target cluster, or a fresh SQLite file in the test's
temporary directory. The PostgreSQL database is only made when asked for.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.config import Config, load_config
from applier.sandbox.clusters import find_install
from tests.plugins.cli import applier_script, clean_env  # noqa: F401 - re-exported to the tests
from tests.plugins.clusters import ScratchDb

NEWEST_PG = find_install().version


@dataclass
class Target:
    """Where changes are applied: kind 'pg' (a scratch database) or 'sqlite' (a file)."""

    kind: str
    url: str
    db: ScratchDb | None = None
    path: Path | None = None

    @property
    def ref(self) -> str:
        """What ``workload.compare`` takes: the libpq DSN or the SQLite path."""
        return self.db.dsn if self.db is not None else str(self.path)

    def execute_script(self, pg_sql: str, sqlite_sql: str) -> None:
        """Run DDL: ``pg_sql`` on a PostgreSQL target, ``sqlite_sql`` on a SQLite one."""
        if self.db is not None:
            with psycopg.connect(self.db.dsn, autocommit=True) as conn:
                conn.execute(pg_sql)  # type: ignore[arg-type]
        else:
            db = sqlite3.connect(self.path)  # type: ignore[arg-type]
            try:
                db.executescript(sqlite_sql)
            finally:
                db.close()

    def query(self, pg_sql: str, sqlite_sql: str | None = None) -> list[tuple[Any, ...]]:
        """Rows of a query on the target."""
        if self.db is not None:
            return self.db.cluster.execute(pg_sql, self.db.dbname)
        db = sqlite3.connect(self.path)  # type: ignore[arg-type]
        try:
            return db.execute(sqlite_sql or pg_sql).fetchall()
        finally:
            db.close()


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """A fresh target of the kind given by indirect parametrization ('pg' or 'sqlite')."""
    kind = request.param
    if kind == "pg":
        db: ScratchDb = request.getfixturevalue("target_db")
        return Target("pg", db.url, db=db)
    path = tmp_path / "replica.db"
    return Target("sqlite", f"sqlite:///{path}", path=path)


def make_cfg(source: ScratchDb, target: Target, work_dir: Path, **extra: Any) -> Config:
    """A config for ``source`` → ``target`` (slot named after the source database, so never shared)."""
    overrides = {"source.dsn": source.dsn, "source.slot": source.dbname, "target.url": target.url,
                 "apply.work_dir": str(work_dir), **{k.replace("__", "."): v for k, v in extra.items()}}
    return load_config(None, overrides, env={})


