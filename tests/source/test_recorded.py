"""Recordings: frames written by ``RecordWriter`` come back from ``RecordedSource`` unchanged.

A damaged file is a ``SourceError`` naming the file and the byte offset of the
bad record, never a silently shorter stream.
"""

from __future__ import annotations

import json

import pytest

from applier.decoder.messages import Keepalive, XLogData
from applier.lsn import LSN
from applier.source.base import SourceError
from applier.source.recorded import RecordedSource, RecordWriter

HEADER = {"slot": "s", "server_version": 180001, "options": {"proto_version": "4", "publication_names": '"pub"'}}
RECORD_HEAD = 1 + 8 + 8 + 8 + 1 + 4  # kind, lsn1, lsn2, time, flag, length (from the format in the module header)

FRAMES = [
    Keepalive(LSN.parse("0/1A2B3C4"), 848712284735484, False),
    XLogData(LSN.parse("0/1A2B3C4"), LSN.parse("0/1A2B3C4"), 848712284738927, b"B" + bytes(20)),
    XLogData(LSN(0), LSN(0), 848712284738928, b"R\x00\x00@\x01public\x00t\x00d\x00\x00"),
    XLogData(LSN.parse("0/1A2B3C4"), LSN.parse("0/1A2B400"), 848712284738929, b"I" + bytes(range(256)) * 40),
    Keepalive(LSN.parse("FFFFFFFF/FFFFFFFF"), -1, True),
    XLogData(LSN.parse("12/34567890"), LSN.parse("12/34567899"), 0, b""),
]


def record_size(frame) -> int:
    return RECORD_HEAD + (len(frame.payload) if isinstance(frame, XLogData) else 0)


def write(path, frames=FRAMES, header=HEADER):
    with RecordWriter(path, header) as w:
        for f in frames:
            w.write(f)
    return w


def read_all(src) -> list:
    out = []
    while (f := src.read(0)) is not None:
        out.append(f)
    return out


def records_start(path) -> int:
    """Byte offset of the first record: after the magic line and the JSON header line."""
    data = path.read_bytes()
    return data.index(b"\n", data.index(b"\n") + 1) + 1


def test_round_trip(tmp_path):
    path = tmp_path / "s.rec"
    w = write(path)
    assert w.count == len(FRAMES)
    src = RecordedSource(path)
    assert src.header == {"format": 1, **HEADER}
    got = read_all(src)
    assert got == FRAMES
    assert [type(f) for f in got] == [type(f) for f in FRAMES]
    assert all(isinstance(f.wal_end, LSN) for f in got)
    assert src.exhausted
    assert src.read(0) is None
    src.confirm(LSN(100))
    src.confirm(LSN(50))
    assert src.confirmed == 100
    src.close()
    assert path.stat().st_size == records_start(path) + sum(record_size(f) for f in FRAMES)


def test_empty_recording_is_exhausted_at_once(tmp_path):
    path = tmp_path / "empty.rec"
    write(path, frames=[])
    src = RecordedSource(path)
    assert src.read(0) is None
    assert src.exhausted
    src.close()


@pytest.mark.parametrize("cut", [1, RECORD_HEAD - 1, RECORD_HEAD, RECORD_HEAD + 100], ids=lambda n: f"keep{n}")
def test_truncated_record_names_the_file_and_offset(tmp_path, cut):
    path = tmp_path / "cut.rec"
    write(path)
    # Keep the first three records whole and `cut` bytes of the fourth (a big XLogData).
    offset = records_start(path) + sum(record_size(f) for f in FRAMES[:3])
    with open(path, "r+b") as f:
        f.truncate(offset + cut)
    src = RecordedSource(path)
    assert [src.read(0) for _ in range(3)] == FRAMES[:3]
    with pytest.raises(SourceError) as exc:
        src.read(0)
    msg = str(exc.value)
    assert str(path) in msg
    assert f"byte {offset}" in msg
    src.close()


def test_bad_magic(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text('{"type": "Begin"}\n')
    with pytest.raises(SourceError, match="not an applier recording") as exc:
        RecordedSource(path)
    assert str(path) in str(exc.value)


def test_empty_file_is_not_a_recording(tmp_path):
    path = tmp_path / "zero.rec"
    path.write_bytes(b"")
    with pytest.raises(SourceError, match="not an applier recording"):
        RecordedSource(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.rec"
    with pytest.raises(SourceError) as exc:
        RecordedSource(path)
    assert str(path) in str(exc.value)


def test_bad_header(tmp_path):
    path = tmp_path / "hdr.rec"
    write(path)
    data = path.read_bytes()
    start = data.index(b"\n") + 1
    path.write_bytes(data[:start] + b"not json\n")
    with pytest.raises(SourceError, match=f"byte {start}"):
        RecordedSource(path)


def test_unsupported_format(tmp_path):
    path = tmp_path / "v2.rec"
    write(path)
    data = path.read_bytes()
    start = data.index(b"\n") + 1
    end = data.index(b"\n", start)
    header = json.loads(data[start:end]) | {"format": 2}
    path.write_bytes(data[:start] + json.dumps(header).encode() + data[end:])
    with pytest.raises(SourceError, match="format 2"):
        RecordedSource(path)


def test_bad_record_kind_names_its_offset(tmp_path):
    path = tmp_path / "kind.rec"
    write(path)
    offset = records_start(path) + record_size(FRAMES[0])
    data = bytearray(path.read_bytes())
    data[offset] = ord("x")
    path.write_bytes(bytes(data))
    src = RecordedSource(path)
    assert src.read(0) == FRAMES[0]
    with pytest.raises(SourceError, match=f"byte {offset}"):
        src.read(0)
    src.close()
