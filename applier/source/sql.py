"""The SQL-interface source: ``pg_logical_slot_peek_binary_changes`` on an ordinary connection.

For places where a replication connection is not allowed (a pooler, a managed
service). Peeking does not consume; ``confirm`` moves the slot with
``pg_replication_slot_advance``. Each peek returns whole transactions, so a
batch always ends on a transaction boundary. A peek after an unconfirmed batch
returns the same changes again, so each is handed out once per source object by
skipping whole units (a transaction, a stream block, a standalone message)
whose last row is at or below the last unit handed out. Rows are not skipped
one by one: a transaction that began before an earlier-committed one has
rows below that one's commit. When every row of a full batch was seen
already, the peek is repeated with a larger limit, so an unconfirmed slot
still makes progress.

Each row becomes an ``XLogData`` whose start and WAL end are the row's LSN.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg

from applier.decoder.framing import Frame
from applier.decoder.messages import AT_RECORD_END, CLOSES_BLOCK, OPENS_BLOCK, XLogData, kind_of
from applier.lsn import LSN
from applier.source.base import SourceError, SourceUnreachable, StreamOptions, slot_in_use
from applier.source.session import session_dsn
from applier.text import one_line


class SqlSlotSource:
    """A source that peeks a logical slot through SQL; ``once`` stops at the first empty peek."""

    def __init__(self, dsn: str, slot: str, options: StreamOptions, *, batch_changes: int = 10000,
                 once: bool = False, poll_interval: float = 0.5) -> None:
        try:
            self.conn = psycopg.connect(session_dsn(dsn), autocommit=True)  # the values' text as a walsender's
        except psycopg.Error as exc:
            raise SourceUnreachable(f"cannot connect to the source: {one_line(exc)}") from None
        self.slot = slot
        self.pairs = options.as_pairs(self.conn.info.server_version)
        self.batch_changes = batch_changes
        self.once = once
        self.poll_interval = poll_interval
        self.exhausted = False
        self._buffer: list[XLogData] = []
        self._pos = 0
        self._last: tuple[int, bool] = (LSN(0), False)
        self._confirmed: LSN = LSN(0)

    def _peek(self) -> list[XLogData]:
        flat: list[str] = [x for pair in self.pairs for x in pair]
        sql = "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s" + ", %s" * len(flat) + ")"
        limit = self.batch_changes
        while True:
            try:
                rows = self.conn.execute(sql, [self.slot, limit, *flat]).fetchall()
            except psycopg.Error as exc:
                if exc.sqlstate == "55006":
                    raise slot_in_use(self.slot, str(exc)) from None
                raise SourceError(f"cannot peek slot {self.slot!r}: {one_line(exc)}") from None
            out: list[XLogData] = []
            unit: list[XLogData] = []
            open_ = False
            for lsn_text, data in rows:
                lsn = LSN.parse(lsn_text)
                payload = bytes(data)
                unit.append(XLogData(lsn, lsn, 0, payload))
                kind = kind_of(payload)
                if kind in OPENS_BLOCK:
                    open_ = True
                if open_ and kind not in CLOSES_BLOCK:
                    continue
                open_ = False
                # Rows at the end of their WAL record (AT_RECORD_END: commit-like) vs. rows at the start of
                # theirs (M/A/E): the former sort first on a tie.
                if (lsn, kind not in AT_RECORD_END) > self._last:
                    out.extend(unit)
                unit = []
            out.extend(unit)
            if out or limit <= 0 or len(rows) < limit:
                return out
            limit = len(rows) + self.batch_changes

    def read(self, timeout: float) -> Frame | None:
        """The next peeked message, or None when the slot has nothing new within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._pos >= len(self._buffer):
            if self.exhausted:
                return None
            self._buffer, self._pos = self._peek(), 0
            if self._buffer:
                break
            if self.once:
                self.exhausted = True
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        frame = self._buffer[self._pos]
        self._pos += 1
        if self._pos == len(self._buffer):
            self._last = (frame.start, kind_of(frame.payload) not in AT_RECORD_END)
        return frame

    def confirm(self, lsn: LSN) -> None:
        """Advance the slot to ``lsn`` (never backwards)."""
        if lsn <= self._confirmed:
            return
        try:
            self.conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", [self.slot, str(lsn)])
        except psycopg.Error as exc:
            raise SourceError(f"cannot advance slot {self.slot!r} to {lsn}: {one_line(exc)}") from None
        self._confirmed = LSN(lsn)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement on the source connection and return its rows; a failure is a SourceError (as the
        walsender's ``command``)."""
        try:
            return self.conn.execute(sql, params).fetchall()
        except psycopg.Error as exc:
            raise SourceError(f"cannot query the source: {one_line(exc)}") from None

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()
