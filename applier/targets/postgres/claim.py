"""The claim of a PostgreSQL target's progress row: a session-level advisory lock (see ``applier.targets.claim``).

The lock lives exactly as long as the session that writes: if that session dies, its writes die with it, and
the lock is free. The session's ``application_name`` says who holds it (command, OS pid, host); a holder of this
host whose process is gone is a stale claim, taken over.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import time
import weakref
from typing import Any

import psycopg

from applier.targets.claim import ProcessClaim, refusal, who_am_i


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


class PgProcessClaim(ProcessClaim):
    """The advisory lock held by this process on a connection of its own, through its sessions' retries: the
    connection the start-up checks handed on (``adopt``) the first time, if they did."""

    def __init__(self, location: str, name: str, command: str, connect_timeout: int = 10) -> None:
        self.location = location  # the libpq conninfo of the target
        self.name = name
        self.command = command
        self.connect_timeout = connect_timeout
        self._conn: psycopg.Connection[Any] | None = None
        self._held = False  # whether the lock is taken on ``_conn`` (an adopted connection is not yet)

    def adopt(self, conn: Any) -> bool:
        if self._held:
            return False
        self.release()  # a connection an earlier try of the checks handed on (``run`` waiting for the databases)
        self._conn = conn
        return True

    def hold(self) -> None:
        conn = self._conn
        if conn is not None and not conn.closed:
            try:
                if self._held:
                    conn.execute("SELECT 1")  # the lock lives as long as this session: is it still there?
                else:
                    self._take(conn)
                return
            except psycopg.Error:  # lost (or refused: taken again below, which says so)
                conn.close()
        self._conn = None
        self._held = False
        conn = psycopg.connect(self.location, autocommit=True, connect_timeout=self.connect_timeout)
        try:
            self._take(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _take(self, conn: psycopg.Connection[Any]) -> None:
        pg_claim(conn, self.name, self.command)
        self._held = True

    def release(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None
        self._held = False
