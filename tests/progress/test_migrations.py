"""The control tables: alembic brings them to the head the apply path expects."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from applier.progress.migrate import head_revision, migrate
from applier.progress.store import HEAD_REVISION, VERSION_TABLE


def test_head_constant_matches_the_migration_scripts() -> None:
    assert head_revision() == HEAD_REVISION


def test_migrate_creates_control_tables_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert migrate(url) == (None, HEAD_REVISION)
    assert migrate(url) == (HEAD_REVISION, HEAD_REVISION)
    db = sqlite3.connect(tmp_path / "r.db")
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"applier_progress", "applier_prepared", VERSION_TABLE} <= tables
