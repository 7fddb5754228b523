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

A write that fails (a full disk above all) raises ``SpoolError`` naming the
file; ``remove`` deletes the file even when its buffered bytes cannot be
written, so a full work directory is emptied, not kept full.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from applier.errors import ApplyError
from applier.text import human_bytes

_HEAD = struct.Struct(">BI")


def record(in_stream: bool, raw: bytes) -> bytes:
    """One spool record: the stream flag, the length, the message (what ``records`` reads back)."""
    return _HEAD.pack(in_stream, len(raw)) + raw


def records(data: bytes) -> Iterator[tuple[bool, bytes]]:
    """(in_stream, message) pairs of spool records held in memory."""
    pos, end = 0, len(data)
    while pos < end:
        flag, n = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        yield bool(flag), data[pos : pos + n]
        pos += n


class SpoolError(ApplyError):
    """A spool file could not be written; the message names the file and the work directory."""


class SpoolFull(SpoolError):
    """The work directory has no room for a streamed transaction (ENOSPC, EDQUOT).

    Not a change the target refuses: once there is room the transaction applies as it is.
    """


class Spool:
    """One streamed transaction's changes on disk."""

    __slots__ = ("xid", "path", "_f", "first_offset", "count", "opened")

    def __init__(self, directory: Path, xid: int, fresh: bool) -> None:
        self.xid = xid
        self.path = directory / f"stream-{xid}.spool"
        try:
            self._f: BinaryIO = open(self.path, "wb" if fresh or not self.path.exists() else "ab")  # noqa: SIM115
        except OSError as exc:
            raise self._failed(exc) from exc
        self.first_offset: dict[int, int] = {}
        self.count = 0
        self.opened = time.time()  # when its first change was received (unix seconds): the metrics' lag

    def append(self, subxid: int, data: bytes, in_stream: bool = True) -> None:
        """Append one message of (sub)transaction ``subxid``."""
        f = self._f
        if subxid not in self.first_offset:
            self.first_offset[subxid] = f.tell()
        try:
            f.write(_HEAD.pack(in_stream, len(data)))
            f.write(data)
        except OSError as exc:
            raise self._failed(exc) from exc
        self.count += 1

    def flush(self) -> None:
        """Write what is buffered to the file (SpoolError if it cannot be written)."""
        try:
            self._f.flush()
        except OSError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: OSError) -> SpoolError:
        """The error for a failed write: for a full disk, how far the spool got and the room it needs."""
        where = self.path.parent
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return SpoolError(f"cannot write spool file {self.path} of streamed transaction {self.xid} in "
                              f"apply.work_dir ({where}): {exc.strerror or exc}")
        try:
            size = self.path.stat().st_size
            free = shutil.disk_usage(where).free
        except OSError:
            size = free = 0
        return SpoolFull(
            f"no space left for spool file {self.path} of streamed transaction {self.xid}: apply.work_dir ({where}) "
            f"has {human_bytes(free)} free, and this transaction needs more than the {human_bytes(size)} spooled "
            f"so far; the spool file is removed: make room there or point apply.work_dir at a bigger disk")

    def abort_sub(self, subxid: int) -> None:
        """Drop the changes of ``subxid`` and of everything spooled after its first change."""
        off = self.first_offset.get(subxid)
        if off is None:
            return
        self.flush()
        self._f.truncate(off)
        self._f.seek(off)
        self.first_offset = {x: o for x, o in self.first_offset.items() if o < off}

    def messages(self) -> Iterator[tuple[bool, bytes]]:
        """The spooled (in_stream, message) pairs in order, read from disk as they are used."""
        self.flush()
        with open(self.path, "rb") as f:
            while True:
                head = f.read(_HEAD.size)
                if not head:
                    return
                flag, n = _HEAD.unpack(head)
                yield bool(flag), f.read(n)

    def read_all(self) -> bytes:
        """The whole spool as bytes (records as ``records`` reads them)."""
        self.flush()
        return self.path.read_bytes()

    def remove(self) -> None:
        """Close and delete the file; never fails for bytes that no longer fit (a full disk)."""
        try:
            self._f.close()  # closes the file even when flushing its buffer fails
        except OSError:
            pass  # the file goes anyway: what could not be written is not wanted
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

    def size(self) -> int:
        """Bytes in the spool files on disk (written out so far), for the metrics; safe from another thread."""
        total = 0
        for sp in list(self.spools.values()):
            try:
                total += sp.path.stat().st_size
            except OSError:  # removed meanwhile
                pass
        return total

    def since(self) -> float | None:
        """When the oldest spool's first change was received (unix seconds); None without spools."""
        return min((sp.opened for sp in list(self.spools.values())), default=None)  # safe from another thread

    def pop(self, xid: int) -> Spool | None:
        """Take the spool of ``xid`` out of the set."""
        return self.spools.pop(xid, None)

    def clear(self) -> None:
        """Remove every spool (a new replication session starts)."""
        for sp in self.spools.values():
            sp.remove()
        self.spools.clear()
