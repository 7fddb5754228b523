"""The receiver thread: frames come out in order, and what waits for the apply thread stays bounded in bytes.

The source is a real recording on disk (``RecordedSource``) of Insert messages
with 1 MB values, the shape of a wide-row workload; nothing is mocked.
"""

from __future__ import annotations

import struct
import time

from applier.decoder.framing import XLogData
from applier.decoder.messages import Insert
from applier.lsn import LSN
from applier.source.prefetch import Prefetch
from applier.source.recorded import RecordedSource, RecordWriter

VALUE = 1 << 20


def insert_payload(i: int) -> bytes:
    """pgoutput Insert into relation 16384: one text column of VALUE bytes, the first 8 being ``i``."""
    value = i.to_bytes(8, "big") + bytes(VALUE - 8)
    return b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">h", 1) + b"t" + struct.pack(">i", VALUE) + value


def test_waiting_frames_stay_under_max_bytes_and_arrive_in_order(tmp_path) -> None:
    path = tmp_path / "wide.rec"
    n = 120
    with RecordWriter(path, {"slot": "s", "server_version": 150000, "options": {}}) as w:
        for i in range(n):
            w.write(XLogData(LSN(i + 1), LSN(i + 1), 0, insert_payload(i)))
    pre = Prefetch(RecordedSource(path), chunk=512, max_chunks=64, max_bytes=16 << 20)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # let the receiver fill the queue as far as it may
            before = pre._bytes
            time.sleep(0.2)
            if pre._bytes == before and before > 0:
                break
        assert 8 << 20 < pre._bytes <= 16 << 20, pre._bytes  # bounded by bytes, not by the 64 x 512 frames
        got = []
        while not pre.exhausted:
            chunk = pre.read_chunk(1.0)
            for frame, msg in chunk or []:
                assert isinstance(msg, Insert) and msg.new.values[0][:8] == len(got).to_bytes(8, "big")
                assert frame.wal_end == len(got) + 1
                got.append(frame)
        assert len(got) == n
    finally:
        pre.close()
