"""The SQLite kind of target as a ``Backend`` (see ``applier.targets.backend``): a database file through sqlite3,
no schemas, no inheritance, no replication origins, the claim a lock file beside the database."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from applier.config import Config
from applier.decoder.messages import Relation, Type
from applier.targets.backend import Backend
from applier.targets.base import Converter
from applier.targets.claim import Held, ProcessClaim
from applier.targets.contract import Target
from applier.targets.sqlite.claim import FileProcessClaim, sqlite_claim, sqlite_claim_path, sqlite_holder, unshared
from applier.targets.sqlite.naming import sqlite_target_table
from applier.targets.sqlite.target import FAILURES, SQLITE_SQL, SqliteTarget, sqlite_path
from applier.text import quote_ident
from applier.url import Kind

if TYPE_CHECKING:  # the source connection's type, for the checker only
    import psycopg

# What a plain SQLite connection waits for a lock held by another process (the engine's target waits as long).
SQLITE_TIMEOUT = 60


def _rowid_ranges(conn: sqlite3.Connection, qtable: str, partitions: int) -> list[tuple[int | None, int | None]]:
    """rowid ranges splitting a SQLite table; one unbounded range for WITHOUT ROWID or small tables."""
    try:
        lo, hi = conn.execute(f"SELECT min(rowid), max(rowid) FROM {qtable}").fetchone()
    except sqlite3.OperationalError:  # WITHOUT ROWID
        return [(None, None)]
    if lo is None or partitions <= 1 or hi - lo < 10000:
        return [(None, None)]
    span = hi - lo + 1
    bounds = [lo + span * i // partitions for i in range(partitions + 1)]
    return [(None if i == 0 else bounds[i], None if i == partitions - 1 else bounds[i + 1]) for i in range(partitions)]


class SqliteBackend(Backend):
    """A SQLite database file as the target."""

    kind = Kind.SQLITE
    Error = sqlite3.Error
    failures = FAILURES
    placeholder = "?"
    sql = SQLITE_SQL
    has_schemas = False
    has_inheritance = False
    can_prepare = False
    copies_by_spark = False
    local_file = True
    keeps_types = False
    table_exists_sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    conflicts_writable_sql = \
        "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'applier_conflicts'"

    def location(self, url: str) -> str:
        return sqlite_path(url)

    def claim_key(self, location: str) -> str:
        return str(Path(location).resolve())

    def prepare_copy(self, conn: Any) -> None:
        conn.execute("PRAGMA journal_mode = WAL")

    def missing_file(self, location: str) -> str | None:
        return None if unshared(location) or Path(location).exists() else location

    def open_target(self, cfg: Config, applying: bool) -> Target:
        return SqliteTarget(cfg.target["url"], cfg.apply["name"], cfg.target["tables"])

    def connect(self, cfg: Config, autocommit: bool) -> sqlite3.Connection:
        return sqlite3.connect(self.location(cfg.target["url"]), timeout=SQLITE_TIMEOUT, check_same_thread=False,
                               isolation_level=None if autocommit else "DEFERRED")

    def why_unopened(self, location: str) -> str | None:
        """Why SQLite cannot open (or create) the database file ``location``, said of its directory (sqlite3 says
        only "unable to open database file")."""
        file = Path(location)
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

    def claim(self, conn: Any, location: str, name: str, command: str) -> Held | None:
        return sqlite_claim(location, name, command)

    def holder(self, conn: Any, location: str, name: str) -> str | None:
        return sqlite_holder(location, name)

    def forget_claim(self, location: str, name: str) -> None:
        sqlite_claim_path(location, name).unlink(missing_ok=True)

    def process_claim(self, location: str, name: str, command: str, connect_timeout: int) -> ProcessClaim:
        return FileProcessClaim(location, name, command)

    def target_table(self, rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
        return sqlite_target_table(rel, table_map)

    def binary_converters(self, rel: Relation, types: dict[int, Type],
                          money: Converter | None = None) -> list[Converter]:
        from applier.targets.binary import binary_converters  # start-up time: text mode never loads them

        return binary_converters(rel, types, self.kind, money)

    def transaction(self, conn: Any, statements: list[tuple[str, list[Any]]], durable: bool = False) -> list[int]:
        if durable:
            conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            counts = [conn.execute(sql, params).rowcount for sql, params in statements]
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return counts

    def column_names(self, conn: Any, shown: str, qname: str, defaulted: bool = True) -> list[str]:
        if defaulted:  # table_xinfo: table_info leaves generated columns out
            return [r[1] for r in conn.execute(f"PRAGMA table_xinfo({quote_ident(shown)})")]
        return [r[1] for r in conn.execute(f"PRAGMA table_info({quote_ident(shown)})") if r[4] is None]

    def check_table(self, conn: Any, table: Any, schema: str | None, name: str) -> list[str] | None:
        # function-local imports: start-up time (the table checks and creation, and the source catalog model they
        # use, serve the operator commands, never the apply path)
        from applier.targets.sqlite.schema import check_sqlite_table

        return check_sqlite_table(conn, table, name)

    def prepare_tables(self, conn: Any, tables: list[Any], table_map: dict[str, str],
                       source: Callable[[], AbstractContextManager[psycopg.Connection[Any]]]) -> Any:
        from applier.targets.sqlite.schema import prepare_sqlite_tables  # start-up time: as check_table

        return prepare_sqlite_tables(conn, tables, table_map)

    def set_sequences(self, conn: Any, seqs: list[Any], tables: dict[tuple[str, str], Any], table_map: dict[str, str],
                      margin: int, location: str) -> list[Any]:
        from applier.targets.sqlite.sequences import set_sqlite_sequences  # start-up time: as check_table

        return set_sqlite_sequences(conn, seqs, tables, table_map, margin, location)

    def read_plan(self, conn: Any, location: str, qname: str, columns: list[str], partitions: int) -> tuple[str, str]:
        from applier.migrate.spark.plans import sqlite_plan  # start-up time: only verify reads this way

        return "applier_sqlite", sqlite_plan(location, qname, columns, _rowid_ranges(conn, qname, partitions))

    def exists(self, conn: Any, shown: str, qname: str) -> bool:
        return bool(conn.execute(f"PRAGMA table_info({quote_ident(shown)})").fetchall())


BACKEND = SqliteBackend()
