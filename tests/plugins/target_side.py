"""What test rigs share about their target: SQL on a scratch PostgreSQL database or a SQLite file."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.plugins.clusters import ScratchDb


class TargetSide:
    """Mixin: ``target`` is a scratch PostgreSQL database, or None for the SQLite file ``sqlite_path``."""

    target: ScratchDb | None
    sqlite_path: Path

    def tgt(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement on the target; its rows."""
        if self.target is not None:
            return self.target.cluster.execute(query, self.target.dbname, params)
        conn = sqlite3.connect(self.sqlite_path, isolation_level=None, timeout=30)
        try:
            cur = conn.execute(query, params or ())
            return cur.fetchall() if cur.description is not None else []
        finally:
            conn.close()

    def tgt_script(self, script: str) -> None:
        """Several ;-separated statements on the target (DDL)."""
        if self.target is not None:
            self.target.cluster.execute(script, self.target.dbname)
            return
        conn = sqlite3.connect(self.sqlite_path, isolation_level=None)
        try:
            conn.executescript(script)
        finally:
            conn.close()
