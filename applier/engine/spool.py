"""Spool files for streamed (in-progress) transactions.

Between Stream Start and Stream Stop the server sends changes of a transaction
that has not committed yet. They are appended, as raw pgoutput bytes, to one
file per top-level xid in the work directory, never held whole in memory.

Record format: uint8 flag (1: the message was sent inside a stream block and
carries the streamed xid; 0: it was not), uint32 length, then the message bytes,
decoded again at replay. The same records, read back whole, are what a SQLite
target keeps for a prepared transaction (``records``).

Subtransaction aborts: the offset of each subxid's first change is kept; a
Stream Abort of a subxid truncates the file there, which drops that
subtransaction and every later change (its children, which can only come
after it). A first segment (``StreamStart.first_segment``) for an xid that
already has a file means the server is sending the transaction again after a
restart: the stale file is replaced.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_HEAD = struct.Struct(">BI")


def records(data: bytes) -> Iterator[tuple[bool, bytes]]:
    """(in_stream, message) pairs of spool records held in memory."""
    pos, end = 0, len(data)
    while pos < end:
        flag, n = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        yield bool(flag), data[pos : pos + n]
        pos += n


class Spool:
    """One streamed transaction's changes on disk."""

    __slots__ = ("xid", "path", "_f", "first_offset", "count")

    def __init__(self, directory: Path, xid: int, fresh: bool) -> None:
        self.xid = xid
        self.path = directory / f"stream-{xid}.spool"
        self._f: BinaryIO = open(self.path, "wb" if fresh or not self.path.exists() else "ab")  # noqa: SIM115
        self.first_offset: dict[int, int] = {}
        self.count = 0

    def append(self, subxid: int, data: bytes, in_stream: bool = True) -> None:
        """Append one message of (sub)transaction ``subxid``."""
        if subxid not in self.first_offset:
            self.first_offset[subxid] = self._f.tell()
        self._f.write(_HEAD.pack(in_stream, len(data)))
        self._f.write(data)
        self.count += 1

    def abort_sub(self, subxid: int) -> None:
        """Drop the changes of ``subxid`` and of everything spooled after its first change."""
        off = self.first_offset.get(subxid)
        if off is None:
            return
        self._f.flush()
        self._f.truncate(off)
        self._f.seek(off)
        self.first_offset = {x: o for x, o in self.first_offset.items() if o < off}

    def messages(self) -> Iterator[tuple[bool, bytes]]:
        """The spooled (in_stream, message) pairs in order, read from disk as they are used."""
        self._f.flush()
        with open(self.path, "rb") as f:
            while True:
                head = f.read(_HEAD.size)
                if not head:
                    return
                flag, n = _HEAD.unpack(head)
                yield bool(flag), f.read(n)

    def read_all(self) -> bytes:
        """The whole spool as bytes (records as ``records`` reads them)."""
        self._f.flush()
        return self.path.read_bytes()

    def remove(self) -> None:
        """Close and delete the file."""
        self._f.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SpoolSet:
    """The spools of a work directory, by top-level xid."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("stream-*.spool"):  # from before a restart: the server sends them again
            stale.unlink()
        self.spools: dict[int, Spool] = {}

    def open(self, xid: int, first_segment: bool) -> Spool:
        """The spool of ``xid`` (a fresh file for a first segment)."""
        sp = self.spools.get(xid)
        if sp is None or first_segment:
            if sp is not None:
                sp.remove()
            sp = self.spools[xid] = Spool(self.dir, xid, fresh=True)
        return sp

    def pop(self, xid: int) -> Spool | None:
        """Take the spool of ``xid`` out of the set."""
        return self.spools.pop(xid, None)

    def clear(self) -> None:
        """Remove every spool (a new replication session starts)."""
        for sp in self.spools.values():
            sp.remove()
        self.spools.clear()
