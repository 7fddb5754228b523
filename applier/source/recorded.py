"""Recorded streams: replication frames stored in a file, replayable as a source.

File format (version 1), all integers big-endian:

    magic     b"APPLIER-STREAM\\n"
    header    one line of JSON ending in b"\\n": {"format": 1, "options": {...},
              "server_version": int, "slot": str, "start_lsn": "X/Y"}
    records   until end of file, each:
              kind    1 byte   b"w" (XLogData) or b"k" (Primary keepalive)
              lsn1    uint64   w: start LSN      k: WAL end
              lsn2    uint64   w: WAL end        k: 0
              time    int64    server send time, µs since 2000-01-01
              flag    uint8    w: 0              k: 1 if a reply was requested
              length  uint32   payload length (0 for k)
              payload bytes    the pgoutput message

A record cut short at the end of the file (a recorder killed mid-write) is an
error naming the file and byte offset, not silently dropped.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from applier.decoder.framing import Frame
from applier.decoder.messages import Keepalive, XLogData
from applier.lsn import LSN
from applier.source.base import SourceError

MAGIC = b"APPLIER-STREAM\n"
_REC = struct.Struct(">cQQqBI")


class RecordWriter:
    """Appends frames to a recording."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        try:
            self._f: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            folder = self.path.parent
            why = f"the directory {folder} does not exist" if not folder.is_dir() else exc.strerror or str(exc)
            raise SourceError(f"{self.path}: cannot write the recording: {why}") from None
        self._f.write(MAGIC)
        self._f.write(json.dumps({"format": 1, **header}, sort_keys=True).encode() + b"\n")
        self.count = 0

    def write(self, frame: Frame) -> None:
        """Append one frame."""
        if type(frame) is XLogData:
            self._f.write(_REC.pack(b"w", frame.start, frame.wal_end, frame.send_time, 0, len(frame.payload)))
            self._f.write(frame.payload)
        else:
            assert isinstance(frame, Keepalive)
            self._f.write(_REC.pack(b"k", frame.wal_end, 0, frame.send_time, int(frame.reply_requested), 0))
        self.count += 1

    def close(self) -> None:
        """Flush and close the file."""
        self._f.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordedSource:
    """Replays a recording; ``confirm`` only remembers the position (nothing to tell)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._f: BinaryIO = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise SourceError(f"{self.path}: cannot open recording: {exc.strerror}") from None
        if self._f.read(len(MAGIC)) != MAGIC:
            raise SourceError(f"{self.path}: not an applier recording (bad magic at byte 0)")
        line = self._f.readline()
        try:
            self.header: dict[str, Any] = json.loads(line)
        except ValueError:
            raise SourceError(f"{self.path}: bad header at byte {len(MAGIC)}: not JSON") from None
        if self.header.get("format") != 1:
            raise SourceError(f"{self.path}: unsupported recording format {self.header.get('format')!r}")
        self.exhausted = False
        self.confirmed = LSN(0)

    def read(self, timeout: float = 0.0) -> Frame | None:
        """The next recorded frame, or None at the end of the file."""
        if self.exhausted:
            return None
        offset = self._f.tell()
        head = self._f.read(_REC.size)
        if not head:
            self.exhausted = True
            return None
        if len(head) < _REC.size:
            raise SourceError(f"{self.path}: record cut short at byte {offset}")
        kind, a, b, ts, flag, n = _REC.unpack(head)
        if kind == b"w":
            payload = self._f.read(n)
            if len(payload) < n:
                raise SourceError(f"{self.path}: record payload cut short at byte {offset}")
            return XLogData(LSN(a), LSN(b), ts, payload)
        if kind == b"k" and n == 0:
            return Keepalive(LSN(a), ts, bool(flag))
        raise SourceError(f"{self.path}: bad record kind {kind!r} at byte {offset}")

    def confirm(self, lsn: LSN) -> None:
        """Remember the highest confirmed position."""
        self.confirmed = LSN(max(self.confirmed, lsn))

    def close(self) -> None:
        """Close the file."""
        self._f.close()
