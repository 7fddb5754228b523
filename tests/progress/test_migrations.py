"""The control tables: alembic brings them to the head the apply path expects."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from applier.progress.migrate import head_revision, migrate
from applier.progress.store import HEAD_REVISION, VERSION_TABLE
from tests.plugins.clusters import ScratchDb


def test_head_constant_matches_the_migration_scripts() -> None:
    assert head_revision() == HEAD_REVISION


def test_migrate_creates_control_tables_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert migrate(url) == (None, HEAD_REVISION)
    assert migrate(url) == (HEAD_REVISION, HEAD_REVISION)
    db = sqlite3.connect(tmp_path / "r.db")
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"applier_progress", "applier_prepared", VERSION_TABLE} <= tables


def test_0003_keeps_sync_tables_that_sync_made_before(tmp_path: Path) -> None:
    """Targets synced before 0003 have applier_sync / applier_sync_parts made by `applier sync`: kept, rows too."""
    from alembic import command
    from sqlalchemy import create_engine

    from applier.progress.migrate import _alembic_config

    url = f"sqlite:///{tmp_path / 'r.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = _alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
    engine.dispose()
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(
        "CREATE TABLE applier_sync (name TEXT PRIMARY KEY, state TEXT NOT NULL, run TEXT NOT NULL, slot TEXT, "
        "consistent_point TEXT, started_at TEXT, finished_at TEXT);"
        "CREATE TABLE applier_sync_parts (name TEXT NOT NULL, run TEXT NOT NULL, tbl TEXT NOT NULL, "
        "part INTEGER NOT NULL, rows BIGINT NOT NULL, bytes BIGINT NOT NULL, PRIMARY KEY (name, run, tbl, part));"
        "INSERT INTO applier_sync VALUES ('default', 'done', 'r1', 'applier', '0/10', NULL, NULL);")
    db.close()
    assert migrate(url) == ("0002", HEAD_REVISION)
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("SELECT state, consistent_point FROM applier_sync").fetchall() == [("done", "0/10")]
    assert db.execute("SELECT count(*) FROM applier_sync_tables").fetchall() == [(0,)]


def test_0010_takes_over_the_tables_marked_as_owing_their_keys(target_db: ScratchDb) -> None:
    """A PostgreSQL target synced by an applier before 0010, killed before the keys of a table it made were built,
    marked that table with a comment: it is owed its keys after the upgrade (the comment gone), and a table with a
    comment of its own is not."""
    from alembic import command
    from sqlalchemy import create_engine

    from applier.progress.migrate import _alembic_config

    engine = create_engine(target_db.url)
    with engine.begin() as conn:
        cfg = _alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0009")
    engine.dispose()
    target_db.cluster.execute(
        "CREATE TABLE \"Owed\" (id int); CREATE TABLE mine (id int); "
        "COMMENT ON TABLE \"Owed\" IS 'applier sync: its primary key and replica identity index are built after the "
        "copy'; COMMENT ON TABLE mine IS 'a comment of its own'", target_db.dbname)
    assert migrate(target_db.url) == ("0009", HEAD_REVISION)
    assert target_db.cluster.execute("SELECT table_oid::oid::regclass::text, table_name FROM applier_keys_owed",
                                     target_db.dbname) == [('"Owed"', "public.Owed")]
    assert target_db.cluster.execute(
        "SELECT obj_description('\"Owed\"'::regclass, 'pg_class'), obj_description('mine'::regclass, 'pg_class')",
        target_db.dbname) == [(None, "a comment of its own")]
