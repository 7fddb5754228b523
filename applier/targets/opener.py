"""Opening the target of a config: the one way in, for the apply engine and for everything else.

``open(cfg)`` gives the target the engine applies to (``PostgresTarget`` / ``SqliteTarget``, chosen by
``target.url``: an ``applier.targets.contract.Target``), and ``failures(cfg)`` how its failures look;
``open(cfg, plain=True)`` a bare DB-API connection (psycopg or sqlite3) for the commands that only check or read
the target (``applier.admin``) or copy into it (``applier.migrate.sync``).

Invariants:
- A target that cannot be reached is one line. The engine's target raises ``TargetUnreachable`` naming "cannot
  connect to the target" (an ``Unreachable``: the runner retries it as a lost connection); a plain connection raises
  ``ConnectError`` naming ``target.url`` (its password redacted; a SQLite file that cannot be opened: why, said of
  its directory).
- Nothing here imports SQLAlchemy or alembic (``applier.targets.url`` parses the URL): the apply commands'
  start-up stays fast.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import psycopg

from applier.config import Config, ConnectError
from applier.targets.contract import Failures, Target
from applier.text import one_line, redact_dsn, redact_text

# What a plain SQLite connection waits for a lock held by another process (the engine's target waits as long).
SQLITE_TIMEOUT = 60


def open(cfg: Config, *, plain: bool = False, applying: bool = True, autocommit: bool = False) -> Any:
    """The target of ``cfg``.

    ``plain=False``: the engine's target; ``applying=False`` to only look at it (no replication origin set up).
    ``plain=True``: a DB-API connection (psycopg or sqlite3; ``autocommit``: every statement its own
    transaction, else the caller commits); ConfigError naming ``target.url`` if it cannot be opened.
    """
    t = cfg.target
    if not plain:
        # here, not at the top: start-up time (only the dialect in use is loaded; postgres.py is ~15 ms)
        target: Target
        if cfg.target_dialect == "sqlite":
            from applier.targets.sqlite import SqliteTarget

            target = SqliteTarget(t["url"], cfg.apply["name"], t["tables"])
        else:
            from applier.targets.postgres import PostgresTarget

            target = PostgresTarget(t["url"], cfg.apply["name"], t["synchronous_commit"], t["tables"],
                                    use_origin=applying, two_phase_mode=t["two_phase_mode"])
        return target
    try:
        if cfg.target_dialect == "sqlite":
            return sqlite3.connect(location(cfg), timeout=SQLITE_TIMEOUT, check_same_thread=False,
                                   isolation_level=None if autocommit else "DEFERRED")
        return psycopg.connect(location(cfg), autocommit=autocommit, connect_timeout=cfg.source["connect_timeout"])
    except (psycopg.Error, sqlite3.Error) as exc:
        why = redact_text(one_line(exc))[:300]
        if isinstance(exc, sqlite3.Error):
            why = sqlite_open_problem(location(cfg)) or why
        raise ConnectError(f"{cfg.where('target', 'url')}: cannot open the target ({redact_dsn(t['url'])}): {why}") \
            from None


def sqlite_open_problem(path: str) -> str | None:
    """Why SQLite cannot open (or create) the database file ``path``, said of its directory, or None if that is
    not it (sqlite3 says only "unable to open database file")."""
    file = Path(path)
    folder = file.parent.resolve()
    if not folder.is_dir():
        return f"the directory {folder} does not exist"
    if not file.exists() and not os.access(folder, os.W_OK | os.X_OK):
        return f"the directory {folder} is not writable (SQLite creates {file.name} in it)"
    if file.exists() and not os.access(file, os.R_OK | os.W_OK):
        return f"the file {file.resolve()} is not readable and writable"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the directory {folder} is not writable (SQLite keeps its journal beside {file.name})"
    return None


def failures(cfg: Config) -> Failures:
    """What a failure on the target of ``cfg`` raises and which of it passes by itself (the target module's
    ``FAILURES``): the runner sorts a session's failures by it."""
    # here, not at the top: start-up time (only the dialect in use is loaded; postgres.py is ~15 ms)
    if cfg.target_dialect == "sqlite":
        from applier.targets.sqlite import FAILURES

        return FAILURES
    from applier.targets.postgres import FAILURES as PG_FAILURES

    return PG_FAILURES


def location(cfg: Config) -> str:
    """Where the target is: the SQLite database file (as given; ':memory:' for sqlite://), or a libpq conninfo."""
    # here, not at the top: start-up time (only the dialect in use is loaded; postgres.py is ~15 ms)
    if cfg.target_dialect == "sqlite":
        from applier.targets.sqlite import sqlite_path

        return sqlite_path(cfg.target["url"])
    from applier.targets.postgres import libpq_dsn

    return libpq_dsn(cfg.target["url"])
