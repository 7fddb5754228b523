"""Looking at a stream without applying it: decode to JSON lines, record to a file.

Library functions behind ``applier decode`` and ``applier record``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from applier.config import Config
from applier.decoder.messages import ENDS_TRANSACTION, Keepalive, XLogData, kind_of
from applier.decoder.pgoutput import Decoder
from applier.decoder.render import render_message
from applier.lsn import LSN
from applier.source.base import Source, SourceError, stream_options
from applier.source.recorded import RecordWriter
from applier.source.sql import SqlSlotSource
from applier.source.walsender import WalSender
from applier.text import one_line


def open_peek_source(cfg: Config) -> SqlSlotSource:
    """A source that peeks the configured slot once through SQL (does not consume)."""
    return SqlSlotSource(cfg.source["dsn"], cfg.source["slot"], stream_options(cfg), once=True)


def decode_stream(src: Source, limit: int | None = None, idle: float = 1.0) -> Iterator[dict[str, Any]]:
    """Yield one JSON-ready dict per pgoutput message: frame LSNs, then every message field."""
    decoder = Decoder()
    n = 0
    while limit is None or n < limit:
        frame = src.read(idle)
        if frame is None:
            return
        if type(frame) is XLogData:
            msg = decoder.decode(frame.payload)
            yield {"lsn": str(LSN(frame.start)), "wal_end": str(LSN(frame.wal_end)), **render_message(msg)}
            n += 1


def current_wal_insert_lsn(dsn: str, flush: bool = False) -> LSN:
    """The source's WAL insert position now (covers asynchronously committed transactions).

    ``flush``: then commit a transaction that only takes an xid, so the WAL up to that position is
    flushed and decodable now; otherwise the last page of a still-open transaction may wait for the
    next WAL activity (the background writer's, up to 15 s on an idle server).
    """
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return wal_insert_lsn(conn, flush)
    except psycopg.Error as exc:
        raise SourceError(f"cannot read the source's WAL position: {one_line(exc)}") from None


def wal_insert_lsn(conn: psycopg.Connection[Any], flush: bool = False) -> LSN:
    """``current_wal_insert_lsn`` on ``conn``, an autocommit connection to the source the caller has open (a
    connection fewer); SourceError if it fails."""
    try:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        lsn = LSN.parse(row[0])
        if flush:
            conn.execute("SELECT pg_current_xact_id()")
        return lsn
    except psycopg.Error as exc:
        raise SourceError(f"cannot read the source's WAL position: {one_line(exc)}") from None


def record_stream(cfg: Config, out: Path, limit: int | None = None, until: LSN | None = None,
                  idle: float = 10.0) -> tuple[int, LSN]:
    """Record the slot's stream to ``out`` without confirming anything; returns (frames, LSN reached)."""
    target = until if until is not None else current_wal_insert_lsn(cfg.source["dsn"])
    ws = WalSender(cfg.source["dsn"], connect_timeout=cfg.source["connect_timeout"])
    try:
        opts = stream_options(cfg)
        ws.start(cfg.source["slot"], LSN(0), opts)
        header = {"slot": cfg.source["slot"], "server_version": ws.server_version,
                  "options": dict(opts.as_pairs(ws.server_version))}
        reached = LSN(0)
        messages = 0
        with RecordWriter(out, header) as writer:
            while limit is None or messages < limit:
                frame = ws.read(idle)
                if frame is None:
                    break
                writer.write(frame)
                if type(frame) is XLogData:
                    messages += 1
                    reached = LSN(max(reached, frame.wal_end))
                elif isinstance(frame, Keepalive):
                    reached = LSN(max(reached, frame.wal_end))
                if reached >= target and (isinstance(frame, Keepalive) or kind_of(frame.payload) in ENDS_TRANSACTION):
                    break
            return writer.count, reached
    finally:
        ws.close()
