"""One applier per progress row: the claim a target holds while anything applies to it.

Exactly-once rests on the progress row being written by one process: two
appliers with the same ``apply.name`` on one target would each read the same
position and apply every transaction (twice in all). So whoever applies, copies
(``run``, ``catchup``, ``sync``, ``verify`` while it catches up) first *claims* the row, and a second process is refused before it
applies anything, with one line naming the holder.

- PostgreSQL target: a session-level advisory lock on the applying connection
  itself, keyed by the row's name. It lives exactly as long as the session that
  writes: if that session dies, its writes die with it, and the lock is free.
  The session's ``application_name`` says who holds it (command, OS pid, host).
- SQLite target: an exclusive ``flock`` on a file beside the database
  (``<file>.applier-<name>.lock``), whose content says who holds it. The kernel
  releases it when the process ends, however it ends.

Only *looking* (``holder``) never takes the claim.

A process that applies in many sessions (``applier.engine.runner``: a session ends at each lost
connection and the next starts after a backoff) holds the claim as a ``ProcessClaim``: on a
PostgreSQL target on a connection of its own, kept through the retries and taken again before a
session applies if it was lost; on a SQLite target the lock file, kept open. A newcomer is refused
while the process retries, and ``applier status`` names it. The session's target is then told the
claim is held (``claim(command, held=True)``) rather than taking it on its own connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import socket
import time
import weakref
from pathlib import Path
from typing import Any

import psycopg

from applier.errors import InUseError
from applier.targets.base import utc_now
from applier.text import file_safe


def who_am_i(command: str, limit: int = 0) -> str:
    """How this process describes itself to a second one: command, OS pid, host (cut to ``limit`` characters,
    keeping the closing parenthesis, so that ``_gone`` can still read it)."""
    me = f"applier {command} (pid {os.getpid()} on {socket.gethostname()})"
    return me if not limit or len(me) <= limit else me[:limit - 1] + ")"


def refusal(name: str, holder: str) -> InUseError:
    """The one line a second process gets."""
    return InUseError(f"another applier is applying to this target for apply.name {name!r}: {holder}. Two appliers "
                      f"on one progress row would apply every transaction twice; stop that one first, or give this "
                      f"one its own apply.name (and its own slot)")


# -- PostgreSQL -------------------------------------------------------------------------------------

def pg_lock_key(name: str) -> int:
    """The advisory lock key (a signed bigint) of the progress row ``name``."""
    digest = hashlib.blake2b(f"applier progress {name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def pg_claim(conn: Any, name: str, command: str) -> None:
    """Take the advisory lock of ``name`` on ``conn`` (autocommit), or raise naming the holder.

    A holder that was an applier of this host whose process is gone (killed: its backend has not
    noticed yet) is a stale claim: its backend is terminated and the lock taken over.
    """
    conn.execute("SELECT set_config('application_name', %s, false)", [who_am_i(command, 63)])
    deadline = time.monotonic() + STALE_WAIT
    while not conn.execute("SELECT pg_try_advisory_lock(%s)", [pg_lock_key(name)]).fetchone()[0]:
        held = _pg_holder_row(conn, name)
        if held is not None and not _gone(held[0], held[1]):
            raise refusal(name, pg_holder(conn, name) or "a session that has since ended; try again")
        if time.monotonic() > deadline:
            raise refusal(name, pg_holder(conn, name) or "a session that will not end; try again")
        if held is not None:
            conn.execute("SELECT pg_terminate_backend(%s)", [held[1]])
        time.sleep(0.1)
    _HOLDING.add(conn)


STALE_WAIT = 10.0  # seconds to wait for a stale holder's backend to go

# The connections of this process that hold a claim now. A process-wide fact, not configuration: a
# holder naming this process whose backend is none of these is a connection this process lost (the
# server has not noticed yet), which must not lock the process out of its own progress row.
_HOLDING: weakref.WeakSet[Any] = weakref.WeakSet()


def _gone(application_name: str | None, backend: int) -> bool:
    """True when the holder (its ``application_name``, its target ``backend`` pid) is an applier of this host
    that no longer runs, or a connection this process has lost."""
    m = re.search(r"\(pid (\d+) on ([^)]+)\)$", application_name or "")
    if m is None or not socket.gethostname().startswith(m[2]):
        return False
    pid = int(m[1])
    if pid == os.getpid():
        return all(c.closed or c.info.backend_pid != backend for c in list(_HOLDING))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _pg_holder_row(conn: Any, name: str) -> tuple[Any, ...] | None:
    key = pg_lock_key(name) & 0xFFFF_FFFF_FFFF_FFFF  # pg_locks shows the bigint as two oids
    return conn.execute(  # type: ignore[no-any-return]
        "SELECT a.application_name, a.pid, coalesce(host(a.client_addr), 'local'), "
        "to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.classid = %s::oid "
        "AND l.objid = %s::oid AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        [key >> 32, key & 0xFFFF_FFFF]).fetchone()


def pg_holder(conn: Any, name: str) -> str | None:
    """Who holds the lock of ``name`` on this database (None: nobody)."""
    row = _pg_holder_row(conn, name)
    if row is None:
        return None
    app, pid, client, since = row
    return f"{app or 'a session'}, target backend {pid} from {client}, connected since {since}"


# -- SQLite -----------------------------------------------------------------------------------------

def sqlite_claim_path(db_path: str, name: str) -> Path:
    """The lock file of progress row ``name`` of the SQLite database ``db_path``."""
    return Path(f"{Path(db_path).resolve()}.applier-{file_safe(name)}.lock")


class FileClaim:
    """An exclusive ``flock`` on a SQLite database's lock file, held until ``release``."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, name: str, command: str) -> None:
        """Take the lock, writing who holds it; raise naming the holder if another process has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for attempt in range(10):  # ``holder`` of another process may be looking (a brief shared lock)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt == 9:
                        raise refusal(name, self.holder() or "a process that has since ended; try again") from None
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{who_am_i(command)}, since {utc_now()}\n".encode(), 0)
        self._fd = fd

    def holder(self) -> str | None:
        """Who holds the lock (None: nobody); never takes it for longer than the look."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                return text or "another process"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        """Give the lock up (closing the file releases it); the file no longer names this process."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def claim_target(dialect: str, conn: Any, db_path: str, name: str, command: str) -> FileClaim | None:
    """Claim progress row ``name`` of a target: PostgreSQL on its applying ``conn``, SQLite by the lock file of
    ``db_path`` (returned: the caller releases it when it closes the target; None for an in-memory database)."""
    if dialect != "sqlite":
        pg_claim(conn, name, command)
        return None
    if _unshared(db_path):
        return None
    claim = FileClaim(sqlite_claim_path(db_path, name))
    claim.acquire(name, command)
    return claim


def target_holder(dialect: str, conn: Any, db_path: str, name: str) -> str | None:
    """Who holds progress row ``name`` of a target now (None: nobody); takes nothing."""
    if dialect != "sqlite":
        return pg_holder(conn, name)
    return None if _unshared(db_path) else FileClaim(sqlite_claim_path(db_path, name)).holder()


def copy_claim_name(name: str, schema: str, table: str) -> str:
    """The claim key of one table's copy by ``applier sync --table`` (``applier.migrate.add_table``) for progress row
    ``name``: held by that command from before it writes the table's applier_sync_tables row until the row is
    'ready' (or the command ends), so that a second copy of the table is refused and an applier waiting for the
    copy can tell a running copy from a dead one (nobody holds it)."""
    return f"{name}/sync --table {schema}.{table}"


def _unshared(db_path: str) -> bool:
    """An in-memory SQLite database (or a URI one): no other process can reach it."""
    return db_path == ":memory:" or db_path.startswith("file:")


class ProcessClaim:
    """The claim of progress row ``name`` held by this process across its sessions; see the module header."""

    def __init__(self, dialect: str, location: str, name: str, command: str, connect_timeout: int = 10) -> None:
        self.dialect = dialect
        self.location = location  # the libpq conninfo of a PostgreSQL target, the SQLite database's path
        self.name = name
        self.command = command
        self.connect_timeout = connect_timeout
        self._conn: Any = None
        self._file: FileClaim | None = None
        self._held = False

    def hold(self) -> None:
        """Hold the claim now: keep it if it is still held, take it (again) if not. InUseError naming the holder if
        another process has it; a psycopg error if the target cannot be reached (the runner retries)."""
        if self.dialect == "sqlite":
            if not self._held:
                self._file = claim_target("sqlite", None, self.location, self.name, self.command)
                self._held = True
            return
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.execute("SELECT 1")  # the lock lives as long as this session: is it still there?
                return
            except psycopg.Error:
                self._conn.close()
        self._conn = None
        conn = psycopg.connect(self.location, autocommit=True, connect_timeout=self.connect_timeout)
        try:
            pg_claim(conn, self.name, self.command)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def release(self) -> None:
        """Give the claim up."""
        if self._file is not None:
            self._file.release()
            self._file = None
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None
        self._held = False
