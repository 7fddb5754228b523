"""Chunks of decoded frames: in source order, and never more than one chunk's bytes in hand.

The source is a real recording on disk (``RecordedSource``) of Insert messages
with 1 MB values, the shape of a wide-row workload; nothing is mocked.
"""

from __future__ import annotations

import struct

from applier.decoder.messages import Insert, Keepalive, XLogData
from applier.lsn import LSN
from applier.source.chunks import ChunkReader
from applier.source.recorded import RecordedSource, RecordWriter

VALUE = 1 << 20


def insert_payload(i: int) -> bytes:
    """pgoutput Insert into relation 16384: one text column of VALUE bytes, the first 8 being ``i``."""
    value = i.to_bytes(8, "big") + bytes(VALUE - 8)
    return b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">h", 1) + b"t" + struct.pack(">i", VALUE) + value


def test_chunks_are_bounded_in_bytes_and_frames_arrive_in_order(tmp_path) -> None:
    path = tmp_path / "wide.rec"
    n = 40
    with RecordWriter(path, {"slot": "s", "server_version": 150000, "options": {}}) as w:
        for i in range(n):
            w.write(XLogData(LSN(i + 1), LSN(i + 1), 0, insert_payload(i)))
            if i % 10 == 9:
                w.write(Keepalive(LSN(i + 1), 0, False))
    reader = ChunkReader(RecordedSource(path), chunk=512, chunk_bytes=8 << 20)
    got, sizes = [], []
    try:
        while not reader.exhausted:
            chunk = reader.read_chunk(0.1) or []
            sizes.append(sum(len(f.payload) for f, _ in chunk if isinstance(f, XLogData)))
            for frame, msg in chunk:
                if isinstance(frame, Keepalive):
                    assert msg is None and frame.wal_end == len(got)
                    continue
                assert isinstance(msg, Insert) and msg.new.values[0][:8] == len(got).to_bytes(8, "big")
                assert frame.wal_end == len(got) + 1
                got.append(frame)
    finally:
        reader.close()
    assert len(got) == n
    # 512 frames per chunk would be 512 MB here: a chunk ends at 8 MB (the frame that crosses it included)
    assert max(sizes) <= (8 << 20) + insert_payload(0).__len__() and len([s for s in sizes if s]) >= 5


def test_drained_says_whether_a_chunk_took_everything_that_had_arrived(tmp_path) -> None:
    path = tmp_path / "small.rec"
    with RecordWriter(path, {"slot": "s", "server_version": 150000, "options": {}}) as w:
        for i in range(5):
            w.write(XLogData(LSN(i + 1), LSN(i + 1), 0, b"B" + bytes(20)))
    reader = ChunkReader(RecordedSource(path), chunk=3)
    try:
        first = reader.read_chunk(0.1)
        assert first is not None and len(first) == 3 and not reader.drained  # ended at its frame limit
        rest = reader.read_chunk(0.1)
        assert rest is not None and len(rest) == 2 and reader.drained  # took the rest: nothing more had arrived
    finally:
        reader.close()
