"""Receiving and decoding on a thread of its own, while the apply thread waits on the target.

psycopg's libpq calls and ``select`` release the GIL, so a receiver thread that
reads and decodes frames overlaps with the apply thread's waits on the target
(COPY, UPDATE … FROM): the two stages run side by side instead of in turn.

Invariants:
- every call into the wrapped source (read, confirm, status updates) happens on
  the receiver thread while it runs, because a libpq connection must not be used
  from two threads at once; ``confirm`` and ``send_status`` only leave a note for it;
- frames reach the apply thread in source order, in chunks, each frame with its
  decoded message (None for a keepalive);
- at most ``max_chunks`` chunks and about ``max_bytes`` of payload wait (a chunk
  ends early at ``max_bytes / max_chunks``), so a slow target holds the receiver
  back instead of filling memory, whatever the size of the rows;
- an error on the receiver thread is raised on the apply thread at its next read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from applier.decoder import Decoder, XLogData
from applier.decoder.framing import Frame
from applier.lsn import LSN
from applier.source.base import Source

Item = tuple[Frame, Any]


class Prefetch:
    """Runs ``source`` and a decoder on a receiver thread; see the module header."""

    def __init__(self, source: Source, chunk: int = 512, max_chunks: int = 64, max_bytes: int = 32 << 20) -> None:
        self.source = source
        self.chunk = chunk
        self.max_chunks = max_chunks
        self.max_bytes = max_bytes
        self._chunks: deque[tuple[list[Item], int] | BaseException] = deque()
        self._bytes = 0  # payload bytes in the waiting chunks
        self._cv = threading.Condition()
        self._stop = False
        self._confirm: LSN | None = None
        self._want_reply = False
        self._done = False  # the receiver saw the end of a finite source
        self._thread = threading.Thread(target=self._run, name="applier-receive", daemon=True)
        self._thread.start()

    @property
    def exhausted(self) -> bool:
        """A finite source is at its end and everything it gave has been handed out."""
        return self._done and not self._chunks

    def _run(self) -> None:
        decode: Callable[[bytes], Any] = Decoder().decode
        src = self.source
        buf: list[Item] = []
        size = 0
        chunk_bytes = max(1, self.max_bytes // self.max_chunks)
        try:
            while not self._stop:
                if self._confirm is not None:
                    lsn, self._confirm = self._confirm, None
                    src.confirm(lsn)
                if self._want_reply:
                    self._want_reply = False
                    ask = getattr(src, "send_status", None)
                    if ask is not None:
                        ask(True)
                frame = src.read(0.0 if buf else 0.02)  # short: a confirm or a status request waits no longer
                if frame is None:
                    if buf:
                        self._push((buf, size))
                        buf, size = [], 0
                    elif getattr(src, "exhausted", False):
                        self._done = True
                        return
                    continue
                if type(frame) is XLogData:
                    buf.append((frame, decode(frame.payload)))
                    size += len(frame.payload)
                else:
                    buf.append((frame, None))
                if len(buf) >= self.chunk or size >= chunk_bytes:
                    self._push((buf, size))
                    buf, size = [], 0
        except BaseException as exc:  # noqa: BLE001 - handed to the apply thread
            if buf:
                self._push((buf, size))
            self._push(exc)

    def _push(self, item: tuple[list[Item], int] | BaseException) -> None:
        size = item[1] if isinstance(item, tuple) else 0
        with self._cv:
            while (len(self._chunks) >= self.max_chunks or self._bytes + size > self.max_bytes) and self._chunks \
                    and not self._stop:
                self._cv.wait(0.1)
            self._chunks.append(item)
            self._bytes += size
            self._cv.notify_all()

    def read_chunk(self, timeout: float) -> list[Item] | None:
        """The next chunk of (frame, message) pairs, or None if none came within ``timeout`` seconds."""
        with self._cv:
            if not self._chunks and timeout > 0:
                self._cv.wait(timeout)
            if not self._chunks:
                return None
            item = self._chunks.popleft()
            if not isinstance(item, BaseException):
                self._bytes -= item[1]
            self._cv.notify_all()
        if isinstance(item, BaseException):
            raise item
        return item[0]

    def confirm(self, lsn: LSN) -> None:
        """Have the receiver confirm ``lsn`` to the source."""
        if self._confirm is None or lsn > self._confirm:
            self._confirm = lsn

    def send_status(self, reply: bool = False) -> None:
        """Have the receiver send a status update asking the server for a keepalive."""
        self._want_reply = True

    def close(self) -> None:
        """Stop the receiver, pass on the last confirmation, and close the source."""
        self._stop = True
        with self._cv:
            self._cv.notify_all()
        self._thread.join()
        try:
            if self._confirm is not None:
                self.source.confirm(self._confirm)
        finally:
            self.source.close()
