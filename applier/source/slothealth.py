"""How near the replication slot is to invalidation: one cheap read of the slot and the settings that end it.

Contract: ``read(conn, slot)`` runs ``HEALTH_SQL`` (one catalog row and two settings, every supported version) and
returns a ``SlotHealth``: the source's WAL position, and for the slot (``exists``) its ``wal_status``
(reserved/extended/unreserved/lost), the WAL it holds back (``pg_current_wal_lsn() - restart_lsn``),
``safe_wal_size``, ``max_slot_wal_keep_size`` in bytes (-1: unlimited), how long it has been idle (PostgreSQL
17+'s ``inactive_since``; None while something streams from it) and ``idle_replication_slot_timeout`` in seconds
(PostgreSQL 18; 0: off; None before). ``SlotHealth.warnings()`` is one line each for what brings the slot near
invalidation, naming the slot, the figure and the setting: ``wal_status`` unreserved (past
``max_slot_wal_keep_size``: the next checkpoint invalidates it), WAL held back at ``NEAR`` or more of
``max_slot_wal_keep_size``, or idle for ``NEAR`` or more of ``idle_replication_slot_timeout``. A lost slot is no
warning: the appliers stop on it (``applier.source.walsender.slot_state``).

``SlotWatch`` is the running applier's view: it reads the slot on a connection of its own, kept between reads, at
most every ``EVERY`` seconds (the metrics' scrapes and the runner's loop share the answer, from either thread), and
says once when the slot crosses into 'unreserved' (``crossed``). ``KeptConnection`` is that connection (the
metrics' target probe uses one too): made again when lost, never raising.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from applier.text import human_bytes

NEAR = 0.8  # a slot past this share of a limit is near invalidation (``SlotHealth.warnings``)
EVERY = 5.0  # seconds a ``SlotWatch`` read is reused
TIMEOUT = 2  # seconds a ``KeptConnection`` waits for a connection or an answer

# one row whether the slot exists or not: the WAL position is wanted either way
HEALTH_SQL = (
    "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint, s.slot_name IS NOT NULL, s.wal_status, "
    "(pg_current_wal_lsn() - s.restart_lsn)::bigint, s.safe_wal_size, s.active, "
    "extract(epoch FROM now() - (to_jsonb(s) ->> 'inactive_since')::timestamptz)::float8, "
    "(SELECT CASE WHEN setting::bigint < 0 THEN -1 ELSE pg_size_bytes(setting || unit) END FROM pg_settings "
    " WHERE name = 'max_slot_wal_keep_size'), "
    "(SELECT setting::bigint * CASE unit WHEN 'min' THEN 60 WHEN 'h' THEN 3600 WHEN 'd' THEN 86400 ELSE 1 END "
    " FROM pg_settings WHERE name = 'idle_replication_slot_timeout') "
    "FROM (SELECT 1) one LEFT JOIN pg_replication_slots s ON s.slot_name = %s")


@dataclass(frozen=True)
class SlotHealth:
    """One read of the slot (see the module header); the slot's fields are None when it does not exist."""

    slot: str
    wal_lsn: int  # the source's current WAL position, as a number
    exists: bool
    wal_status: str | None = None
    retained: int | None = None  # bytes of WAL the slot holds back
    safe_wal_size: int | None = None  # bytes that can still be written before the slot is in danger (None: no limit)
    active: bool | None = None
    idle_seconds: float | None = None  # since the slot was last streamed from (17+); None while active
    max_keep: int = -1  # max_slot_wal_keep_size in bytes; -1: unlimited
    idle_timeout: int | None = None  # idle_replication_slot_timeout in seconds (18+); 0: off

    def warnings(self) -> list[str]:
        """What brings the slot near invalidation, one line each (empty: nothing; see the module header)."""
        out = []
        slot = self.slot
        if self.wal_status == "unreserved":
            out.append(f"slot {slot!r} has wal_status 'unreserved': it holds {human_bytes(self.retained or 0)} of "
                       f"WAL, past max_slot_wal_keep_size {self.keep_shown()}, and the source's next checkpoint "
                       f"invalidates it unless the replica catches up first")
        elif self.wal_status != "lost" and self.max_keep >= 0 and self.retained is not None \
                and self.retained >= NEAR * self.max_keep:
            out.append(f"slot {slot!r} holds {human_bytes(self.retained)} of WAL, {self.retained / max(1, self.max_keep):.0%} "
                       f"of max_slot_wal_keep_size {self.keep_shown()}: past it the slot is invalidated (start the "
                       f"replica, or raise max_slot_wal_keep_size)")
        if self.wal_status != "lost" and self.idle_timeout and self.idle_seconds is not None \
                and self.idle_seconds >= NEAR * self.idle_timeout:
            out.append(f"slot {slot!r} has been idle for {self.idle_seconds:.0f}s, "
                       f"{self.idle_seconds / self.idle_timeout:.0%} of idle_replication_slot_timeout "
                       f"{self.idle_timeout}s: past it a checkpoint invalidates the slot (start the replica, or raise "
                       f"idle_replication_slot_timeout)")
        return out

    def keep_shown(self) -> str:
        """max_slot_wal_keep_size for people."""
        return "-1 (unlimited)" if self.max_keep < 0 else human_bytes(self.max_keep)

    def timeout_shown(self) -> str | None:
        """idle_replication_slot_timeout for people (None: the server has none, before PostgreSQL 18)."""
        return None if self.idle_timeout is None else "0 (off)" if self.idle_timeout == 0 else f"{self.idle_timeout}s"

    def as_dict(self) -> dict[str, Any]:
        """For ``applier status`` (its flat keys beside ``slot_wal_status`` and ``slot_retained_bytes``)."""
        return {"slot_wal_status": self.wal_status, "slot_retained_bytes": self.retained,
                "slot_safe_wal_size": self.safe_wal_size, "max_slot_wal_keep_size": self.max_keep,
                "slot_idle_seconds": None if self.idle_seconds is None else round(self.idle_seconds, 1),
                "idle_replication_slot_timeout": self.idle_timeout, "slot_warnings": self.warnings()}


def read(conn: psycopg.Connection[Any], slot: str) -> SlotHealth:
    """The slot's health as ``conn`` (the source, not in recovery) sees it now; psycopg.Error if it cannot be read."""
    row = conn.execute(HEALTH_SQL, [slot]).fetchone()
    assert row is not None  # one row always (the LEFT JOIN)
    return of_row(slot, row)


def of_row(slot: str, row: tuple[Any, ...]) -> SlotHealth:
    """A ``HEALTH_SQL`` row as a ``SlotHealth``."""
    wal, exists, wal_status, retained, safe, active, idle, keep, timeout = row
    return SlotHealth(slot, int(wal), bool(exists), wal_status, None if retained is None else int(retained),
                      None if safe is None else int(safe), active,
                      None if idle is None or active else max(0.0, float(idle)),
                      -1 if keep is None else int(keep), None if timeout is None else int(timeout))


class KeptConnection:
    """An autocommit connection to one DSN, kept between reads and made again when lost; ``one`` never raises."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None

    def one(self, sql: str, params: list[Any] | None = None) -> tuple[Any, ...] | None:
        """One row of ``sql``; None if the database cannot be reached or the query fails."""
        conn = self._conn
        try:
            if conn is None or conn.closed:
                conn = self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=TIMEOUT)
                conn.execute(f"SET statement_timeout = {TIMEOUT * 1000}")
            row: tuple[Any, ...] | None = conn.execute(sql, params).fetchone()
            return row
        except psycopg.Error:
            self.close()
            return None

    def close(self) -> None:
        """Close the connection (the next ``one`` makes it again)."""
        if self._conn is not None:
            self._conn.close()
        self._conn = None


class SlotWatch:
    """The slot as a running applier sees it: read at most every ``EVERY`` seconds (see the module header)."""

    def __init__(self, source_dsn: str, slot: str) -> None:
        self.slot = slot
        self.source = KeptConnection(source_dsn)
        self._lock = threading.Lock()
        self._at = -math.inf
        self._last: SlotHealth | None = None  # None: the source could not be asked
        self._status: str | None = None  # the wal_status ``crossed`` last saw

    def read(self) -> SlotHealth | None:
        """The last read if younger than ``EVERY`` seconds, else a new one; None: the source cannot be asked."""
        with self._lock:
            now = time.monotonic()
            if now - self._at >= EVERY:
                self._at = now
                row = self.source.one(HEALTH_SQL, [self.slot])
                self._last = None if row is None else of_row(self.slot, row)
            return self._last

    def due(self) -> bool:
        """Whether a ``read`` now would ask the source."""
        return time.monotonic() - self._at >= EVERY

    def crossed(self) -> str | None:
        """One line when the slot crossed into 'unreserved' since the last call (the first call: when it is
        'unreserved' now), else None; reads as ``read`` does."""
        health = self.read()
        if health is None or not health.exists:
            return None
        before, self._status = self._status, health.wal_status
        if health.wal_status == "unreserved" and before != "unreserved":
            return health.warnings()[0]
        return None

    def close(self) -> None:
        """Close its connection."""
        with self._lock:
            self.source.close()
