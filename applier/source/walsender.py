"""The walsender source: a replication connection streaming pgoutput over COPY_BOTH.

Replication commands go over libpq's simple query protocol (``pgconn.exec_``),
since a walsender accepts nothing else for them. Frames are read with
``get_copy_data(1)`` (non-blocking) after ``select`` on the socket: psycopg's
binary build holds the GIL in a blocking read, which would freeze every other
thread of the process.

Invariants:
- the flush position sent to the server moves only through ``confirm`` and
  never backwards; a keepalive is answered with the position the caller set;
- the write position reported is the highest WAL end received;
- ``stop`` ends COPY_BOTH cleanly (CopyDone, drain, results) so the connection
  can run further commands;
- a connection streams once: PostgreSQL (15 to 18 at least) does not reset its
  end-of-streaming state for a second START_REPLICATION … LOGICAL, whose
  stream then ends at once, so ``start`` refuses a second time;
- a slot that is gone or invalidated is a ``SlotLost`` (``applier.errors``), never a
  connection problem: from the walsender's refusal of START_REPLICATION (``slot_lost``) or
  from the catalog beforehand (``SLOT_STATE``, ``slot_state``).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import pq

from applier._cmodule import twin
from applier.decoder.framing import Frame, encode_standby_status, read_frame
from applier.decoder.messages import Keepalive, PgOutputMessage, XLogData
from applier.decoder.pgoutput import DecodeError, Decoder
from applier.errors import SlotLost
from applier.lsn import LSN
from applier.source.base import FULL, Full, SlotInfo, SourceError, SourceUnreachable, StreamOptions, slot_in_use
from applier.source.session import session_dsn
from applier.text import one_line, quote_ident, quote_literal


def read_decoded_pure(get_copy_data: Callable[[int], tuple[int, Any]],
                      fast: Callable[[bytes, bool], PgOutputMessage | None], in_stream: bool, buf: list[Any],
                      most: int, limit: int, size: int) -> tuple[int, int, int, tuple[int, Any] | None]:
    """Take what libpq already holds while it is XLogData whose message ``fast`` decodes, appending
    (frame, message) to ``buf`` until it holds ``most`` frames or ``size`` (its payload bytes) reaches ``limit``;
    (size, frames taken, highest WAL end taken (0: none), ``get_copy_data(1)``'s (nbytes, data) of the frame not
    taken (None: the chunk is full)). Twin of ``applier._rowpath.read_decoded``."""
    taken = top = 0
    while len(buf) < most and size < limit:
        got = get_copy_data(1)
        if got[0] <= 0:
            return size, taken, top, got
        try:
            frame = read_frame(got[1])
        except DecodeError:  # the caller's ``read`` reads it again and raises
            return size, taken, top, got
        if type(frame) is not XLogData:  # a keepalive: the caller's ``read`` takes it
            return size, taken, top, got
        msg = fast(frame.payload, in_stream)
        if msg is None:
            return size, taken, top, got
        top = max(top, frame.wal_end)
        buf.append((frame, msg))
        size += len(frame.payload)
        taken += 1
    return size, taken, top, None


read_decoded = twin("read_decoded", read_decoded_pure)  # compiled or pure (applier._cmodule)


class WalSender:
    """One replication connection to a database; see the module header."""

    exhausted = False

    def __init__(self, dsn: str, *, status_interval: float = 10.0, connect_timeout: int = 10) -> None:
        try:
            self.conn = psycopg.connect(session_dsn(dsn), replication="database", autocommit=True,
                                        connect_timeout=connect_timeout)
        except psycopg.Error as exc:
            raise SourceUnreachable(f"cannot open a replication connection to the source: {one_line(exc)}") from None
        self.pgconn = self.conn.pgconn
        self.server_version = self.pgconn.server_version
        self.status_interval = status_interval
        self.streaming = False
        self._flush = LSN(0)
        self._received: int = LSN(0)  # a frame's WAL end (plain ints on the hot path)
        self._last_status = 0.0
        self._dirty = False
        self._frames = 0
        self._started = False

    # -- replication commands -------------------------------------------------

    def command(self, sql: str) -> list[tuple[str | None, ...]]:
        """Run one replication command (simple query protocol) and return its rows as text."""
        if self.streaming:
            raise SourceError("cannot run a command while streaming; stop() first")
        res = self._exec(sql)
        if res.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            msg = one_line((res.error_message or b"").decode(errors="replace"))
            raise SourceError(f"source refused {sql.split()[0]} {sql.split()[1] if len(sql.split()) > 1 else ''}: {msg}".strip())
        rows = []
        for i in range(res.ntuples):
            rows.append(tuple(None if v is None else bytes(v).decode() for v in (res.get_value(i, j) for j in range(res.nfields))))
        return rows

    def _exec(self, sql: str) -> pq.abc.PGresult:
        try:
            return self.pgconn.exec_(sql.encode())
        except psycopg.Error as exc:
            raise SourceError(f"replication connection failed running {sql.split()[0]}: {one_line(exc)}") from None

    def identify_system(self) -> dict[str, str | None]:
        """IDENTIFY_SYSTEM: systemid, timeline, xlogpos, dbname."""
        row = self.command("IDENTIFY_SYSTEM")[0]
        return dict(zip(("systemid", "timeline", "xlogpos", "dbname"), row))

    def create_slot(self, slot: str, *, two_phase: bool = False, snapshot: str | None = None,
                    temporary: bool = False, failover: bool = False) -> SlotInfo:
        """CREATE_REPLICATION_SLOT … LOGICAL pgoutput; snapshot is 'export', 'use', 'nothing' or None; ``failover``
        (PostgreSQL 17+: ``applier.source.failover.refusal`` says so before) a slot that standbys synchronize."""
        opts = []
        if two_phase:
            opts.append("TWO_PHASE")
        if failover:
            opts.append("FAILOVER")
        if snapshot is not None:
            opts.append(f"SNAPSHOT {quote_literal(snapshot)}")
        temp = " TEMPORARY" if temporary else ""
        sql = f"CREATE_REPLICATION_SLOT {quote_ident(slot)}{temp} LOGICAL pgoutput"
        if opts:
            sql += " (" + ", ".join(opts) + ")"
        row = self.command(sql)[0]
        return SlotInfo(slot_name=row[0] or slot, consistent_point=LSN.parse(row[1] or "0/0"), snapshot_name=row[2])

    def set_failover(self, slot: str) -> None:
        """ALTER_REPLICATION_SLOT … (FAILOVER true) (PostgreSQL 17+; refused while another process streams from it)."""
        self.command(f"ALTER_REPLICATION_SLOT {quote_ident(slot)} (FAILOVER true)")

    def drop_slot(self, slot: str, wait: bool = True) -> None:
        """DROP_REPLICATION_SLOT."""
        self.command(f"DROP_REPLICATION_SLOT {quote_ident(slot)}{' WAIT' if wait else ''}")

    def start(self, slot: str, start_lsn: LSN, options: StreamOptions) -> None:
        """START_REPLICATION SLOT … LOGICAL start_lsn (options); the flush position starts at start_lsn."""
        if self._started:
            raise SourceError("this replication connection has already streamed; open a new one to stream again")
        pairs = options.as_pairs(self.server_version)
        opt_sql = ", ".join(f"{quote_ident(k)} {quote_literal(v)}" for k, v in pairs)
        sql = f"START_REPLICATION SLOT {quote_ident(slot)} LOGICAL {start_lsn} ({opt_sql})"
        res = self._exec(sql)
        if res.status != pq.ExecStatus.COPY_BOTH:
            msg = one_line((res.error_message or b"").decode(errors="replace"))
            state = res.error_field(pq.DiagnosticField.SQLSTATE)
            if state == b"55006":  # object_in_use: "… is active for PID n"
                raise slot_in_use(slot, msg)
            lost = slot_lost(slot, state, msg, res.error_field(pq.DiagnosticField.MESSAGE_DETAIL))
            if lost is not None:
                raise lost
            raise SourceError(f"source refused START_REPLICATION on slot {slot!r}: {msg}")
        self.streaming = True
        self._started = True
        self._flush = LSN(max(self._flush, start_lsn))
        self._received = LSN(max(self._received, start_lsn))
        self.pgconn.nonblocking = 1

    # -- streaming ------------------------------------------------------------

    def read(self, timeout: float, got: tuple[int, Any] | None = None) -> Frame | None:
        """Next frame, or None after ``timeout`` seconds; answers keepalives that ask for a reply. ``got``: what
        ``get_copy_data`` returned last and nobody took (``read_decoded``), taken first."""
        deadline = -1.0  # set when first needed: a frame that is already here costs no clock read
        pgconn = self.pgconn
        try:  # one frame: no call between here and the frame but get_copy_data and read_frame (once per change)
            while True:
                nbytes, data = got if got is not None else pgconn.get_copy_data(1)
                got = None
                if nbytes > 0:
                    frame = read_frame(data)
                    if type(frame) is XLogData:
                        if frame.wal_end > self._received:
                            self._received = frame.wal_end
                        self._frames += 1
                        if self._frames & 1023:  # look at the clock for status updates every 1024 changes
                            return frame
                    else:
                        assert isinstance(frame, Keepalive)
                        if frame.wal_end > self._received:
                            self._received = frame.wal_end
                        if frame.reply_requested:
                            self.send_status()
                    self._maybe_send_status()
                    return frame
                if nbytes == -1:
                    self._finish_copy()
                    raise SourceError("the source ended replication (server shut down or walsender terminated)")
                if nbytes < -1:
                    raise SourceError(f"replication connection failed: {_pg_error(pgconn)}")
                self._maybe_send_status()
                if deadline < 0:
                    deadline = time.monotonic() + timeout
                remaining = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([pgconn.socket], [], [], min(remaining, self.status_interval))
                if not ready and remaining <= 0:
                    return None
                if ready:
                    pgconn.consume_input()
                    if pgconn.status == pq.ConnStatus.BAD:
                        raise SourceUnreachable(f"replication connection lost: {_pg_error(pgconn)}")
        except psycopg.Error as exc:
            self.streaming = False
            raise SourceUnreachable(f"replication connection lost: {one_line(exc)}") from None

    def read_decoded(self, buf: list[Any], most: int, limit: int, size: int,
                     decoder: Decoder) -> tuple[int, Frame | None | Full]:
        """Frames straight into ``buf``, decoded, while they are changes ``decoder``'s fast path takes, in one call
        (``read_decoded``: compiled, or its twin); (payload bytes in ``buf``, what comes next): ``FULL`` when
        ``buf`` holds ``most`` frames or ``limit`` bytes, else the next frame as ``read(0.0)`` gives it (None:
        nothing more has arrived), which ``buf`` does not have yet."""
        try:
            size, taken, top, got = read_decoded(self.pgconn.get_copy_data, decoder.fast, decoder.in_stream, buf,
                                                   most, limit, size)
        except psycopg.Error as exc:
            self.streaming = False
            raise SourceUnreachable(f"replication connection lost: {one_line(exc)}") from None
        if top > self._received:
            self._received = top
        if taken:
            before = self._frames
            self._frames += taken
            if before >> 10 != self._frames >> 10:  # the clock, for status updates, every 1024 changes (as ``read``)
                self._maybe_send_status()
        return (size, FULL) if got is None else (size, self.read(0.0, got))

    def confirm(self, lsn: LSN) -> None:
        """Set the flush position (only ever forwards); sent on the next status update."""
        if lsn > self._flush:
            self._flush = LSN(lsn)
            self._dirty = True

    @property
    def flushed(self) -> LSN:
        """The flush position as last set by ``confirm``."""
        return self._flush

    @property
    def received(self) -> LSN:
        """The highest WAL end seen from the server."""
        return LSN(self._received)

    def send_status(self, reply: bool = False) -> None:
        """Send a Standby status update now: write = received, flush = apply = confirmed."""
        if not self.streaming:
            return
        write = max(self._received, self._flush)
        msg = encode_standby_status(write, self._flush, self._flush, reply)
        try:
            ok = self.pgconn.put_copy_data(msg) == 1 and self._flush_out()
        except psycopg.Error as exc:
            raise SourceUnreachable(f"cannot send a status update to the source: {one_line(exc)}") from None
        if not ok:
            raise SourceUnreachable(f"cannot send a status update to the source: {one_line(_pg_error(self.pgconn))}")
        self._last_status = time.monotonic()
        self._dirty = False

    def _flush_out(self) -> bool:
        while True:
            r = self.pgconn.flush()
            if r == 0:
                return True
            if r < 0:
                return False
            select.select([], [self.pgconn.socket], [], 1.0)

    def _maybe_send_status(self) -> None:
        now = time.monotonic()
        if now - self._last_status >= self.status_interval or (self._dirty and now - self._last_status >= 1.0):
            self.send_status()

    def stop(self) -> None:
        """End COPY_BOTH cleanly (after a last status update); the connection stays usable."""
        if not self.streaming:
            return
        try:
            self.send_status()
        except SourceError:
            pass
        pgconn = self.pgconn
        try:
            pgconn.put_copy_end()
            self._flush_out()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                nbytes, _ = pgconn.get_copy_data(1)
                if nbytes == 0:
                    select.select([pgconn.socket], [], [], 1.0)
                    pgconn.consume_input()
                    continue
                if nbytes < 0:
                    break
            self._finish_copy()
        except psycopg.Error as exc:
            self.streaming = False
            raise SourceUnreachable(f"replication connection lost while stopping: {one_line(exc)}") from None

    def _finish_copy(self) -> None:
        pgconn = self.pgconn
        pgconn.nonblocking = 0
        while pgconn.get_result() is not None:
            pass
        self.streaming = False

    def close(self) -> None:
        """Stop streaming if needed and close the connection."""
        try:
            if self.streaming and self.pgconn.status == pq.ConnStatus.OK:
                self.stop()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
        finally:
            self.streaming = False
            self.conn.close()

    def __enter__(self) -> WalSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def slot_lost(slot: str, sqlstate: bytes | None, message: str, detail: bytes | None) -> SlotLost | None:
    """The SlotLost of a walsender's refusal of START_REPLICATION, or None for another refusal: undefined_object
    (42704) "replication slot … does not exist", or an invalidated slot (55000): "cannot read from logical
    replication slot" (PostgreSQL 15), "can no longer get changes from replication slot" (16, 17), "can no longer
    access replication slot" (18), with a detail that says why ("This slot has been invalidated because …")."""
    why = one_line((detail or b"").decode(errors="replace")).rstrip(".")
    if sqlstate == b"42704" and "does not exist" in message:
        return SlotLost(slot, "does not exist on the source (dropped)")
    if sqlstate in (b"55000", b"42704") and ("invalidated" in why or "can no longer" in message):
        return SlotLost(slot, f"was invalidated on the source ({why or message})")
    return None


# the slot's position and whether it was invalidated: wal_status 'lost' (its WAL removed), PostgreSQL 17+'s
# invalidation_reason, 16's conflicting (columns a version lacks read as NULL through to_jsonb)
# (and, last, 17+'s failover: 'true', 'false' or NULL before 17)
SLOT_STATE = ("SELECT confirmed_flush_lsn::text, wal_status, to_jsonb(s) ->> 'invalidation_reason', "
              "to_jsonb(s) ->> 'conflicting', to_jsonb(s) ->> 'failover' FROM pg_replication_slots s "
              "WHERE slot_name = %s")


def slot_state(slot: str, row: Any, applied: LSN | None) -> LSN | None:
    """The slot's confirmed position from its ``SLOT_STATE`` row (None: none yet); SlotLost naming ``applied`` (when
    known) if the slot does not exist or was invalidated."""
    if row is None:
        raise SlotLost(slot, "does not exist on the source (dropped)", None if applied is None else str(applied))
    confirmed, wal_status, reason, conflicting = row[:4]
    if reason or wal_status == "lost" or conflicting in (True, "true"):
        why = reason or ("conflict with recovery" if conflicting in (True, "true") else "wal_removed")
        raise SlotLost(slot, f"was invalidated on the source ({why}: wal_status {wal_status or 'lost'})",
                       None if applied is None else str(applied))
    return LSN.parse(confirmed) if confirmed else None


def _pg_error(pgconn: pq.abc.PGconn) -> str:
    return (pgconn.error_message or b"").decode(errors="replace").strip() or "unknown error"



__all__: Sequence[str] = ["WalSender"]
