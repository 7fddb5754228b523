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
- at most ``max_chunks`` chunks wait, so a slow target holds the receiver back
  instead of filling memory;
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

    def __init__(self, source: Source, chunk: int = 512, max_chunks: int = 64) -> None:
        self.source = source
        self.chunk = chunk
        self.max_chunks = max_chunks
        self._chunks: deque[list[Item] | BaseException] = deque()
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
                frame = src.read(0.0 if buf else 0.1)
                if frame is None:
                    if buf:
                        self._push(buf)
                        buf = []
                    elif getattr(src, "exhausted", False):
                        self._done = True
                        return
                    continue
                buf.append((frame, decode(frame.payload) if type(frame) is XLogData else None))
                if len(buf) >= self.chunk:
                    self._push(buf)
                    buf = []
        except BaseException as exc:  # noqa: BLE001 - handed to the apply thread
            if buf:
                self._push(buf)
            self._push(exc)

    def _push(self, item: list[Item] | BaseException) -> None:
        with self._cv:
            while len(self._chunks) >= self.max_chunks and not self._stop:
                self._cv.wait(0.1)
            self._chunks.append(item)
            self._cv.notify_all()

    def read_chunk(self, timeout: float) -> list[Item] | None:
        """The next chunk of (frame, message) pairs, or None if none came within ``timeout`` seconds."""
        with self._cv:
            if not self._chunks and timeout > 0:
                self._cv.wait(timeout)
            if not self._chunks:
                return None
            item = self._chunks.popleft()
            self._cv.notify_all()
        if isinstance(item, BaseException):
            raise item
        return item

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
