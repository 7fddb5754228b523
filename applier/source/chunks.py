"""Frames in chunks, each with its decoded message: what the apply loop reads.

Receiving, decoding and applying run on one thread, in turn. Writes to the
target do not wait for the server (an open COPY, set-based statements sent
ahead: ``applier.targets.postgres.target``), so the target's work already overlaps with
decoding; a receiver thread would only add GIL hand-offs (measured slower on
every bench/apply.py workload, see bench/README.md). A source that offers
``read_decoded`` (the walsender) reads the changes that follow a frame and decodes
them in one call, compiled where the row path is (``applier._rowpath``); the rest
(keepalives, every other message) comes one ``read`` at a time.

Invariants:
- frames come out in source order, each frame with its decoded message (None
  for a keepalive);
- a chunk holds at most ``chunk`` frames and ends once it carries ``chunk_bytes``
  of payload, so wide rows cannot fill memory: at most one chunk is in hand;
- ``read_chunk`` waits at most ``timeout`` seconds for a chunk's first frame,
  never for the rest; ``drained`` says whether the chunk ended because nothing
  more had arrived (rather than at its size limits).
"""

from __future__ import annotations

from typing import Any

from applier.decoder.framing import Frame
from applier.decoder.messages import XLogData
from applier.decoder.pgoutput import Decoder
from applier.lsn import LSN
from applier.source.base import FULL, Source

Item = tuple[Frame, Any]


class ChunkReader:
    """Reads ``source`` and decodes what it gives, a chunk at a time; see the module header."""

    def __init__(self, source: Source, chunk: int = 512, chunk_bytes: int = 8 << 20,
                 system_id: str | None = None, money_text: Any = None, timeline: int | None = None) -> None:
        self.source = source
        self.system_id = system_id  # the source's IDENTIFY_SYSTEM systemid, when it has one
        self.timeline = timeline  # and its timeline
        self.money_text = money_text  # binary mode: how the source session prints money (target.binary.money_text)
        self.chunk = chunk
        self.chunk_bytes = chunk_bytes
        self._decoder = Decoder()
        # a source that reads changes straight into the chunk, decoded, in one call (``WalSender.read_decoded``);
        # looked up on its class: a wrapper that filters ``read`` and forwards other attributes must not lend it
        many = getattr(type(source), "read_decoded", None)
        self._many = many.__get__(source) if many is not None else None
        self.drained = False  # the last chunk took everything that had arrived

    @property
    def exhausted(self) -> bool:
        """A finite source is at its end."""
        return bool(getattr(self.source, "exhausted", False))

    def read_chunk(self, timeout: float) -> list[Item] | None:
        """The next chunk of (frame, message) pairs, or None if no frame came within ``timeout`` seconds."""
        read, decoder, many = self.source.read, self._decoder, self._many
        decode = decoder.decode
        frame = read(timeout)
        if frame is None:
            return None
        buf: list[Item] = []
        size = 0
        limit, most = self.chunk_bytes, self.chunk
        self.drained = False
        while frame is not None:
            if type(frame) is XLogData:
                payload = frame.payload
                buf.append((frame, decode(payload)))
                size += len(payload)
                if size >= limit:
                    break
            else:
                buf.append((frame, None))
            if len(buf) >= most:
                break
            if many is None:
                frame = read(0.0)
                continue
            size, after = many(buf, most, limit, size, decoder)  # the changes that follow, in one call
            if after is FULL:
                break
            frame = after
        else:
            self.drained = True
        return buf

    def confirm(self, lsn: LSN) -> None:
        """Confirm ``lsn`` to the source."""
        self.source.confirm(lsn)

    def send_status(self, reply: bool = False) -> None:
        """Send a status update now (``reply``: ask the server for a keepalive), if the source has them."""
        send = getattr(self.source, "send_status", None)
        if send is not None:
            send(reply)

    def close(self) -> None:
        """Close the source."""
        self.source.close()
