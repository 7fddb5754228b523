"""Bring the target's control tables to the newest alembic revision."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from applier.progress.store import VERSION_TABLE


def migration_dir() -> Path:
    """The alembic scripts: packaged as applier/_migrations in a wheel, or the checkout's migrations/."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("applier's alembic migrations are missing from this installation")


def _alembic_config() -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migration_dir()))
    return cfg


def current_revision(engine: Engine) -> str | None:
    """The revision the target's control tables are at (None: never initialized)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def head_revision() -> str | None:
    """The newest revision this applier knows."""
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def said(before: str | None, after: str | None) -> str | None:
    """The line that says what ``migrate`` did (None: nothing, they were at head)."""
    if before == after:
        return None
    return f"control tables: {'created at' if before is None else f'upgraded from {before} to'} {after}"


def migrate(url: str) -> tuple[str | None, str | None]:
    """Upgrade the control tables to head; returns (revision before, revision after)."""
    engine = create_engine(url)
    try:
        before = current_revision(engine)
        cfg = _alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        return before, current_revision(engine)
    finally:
        engine.dispose()
