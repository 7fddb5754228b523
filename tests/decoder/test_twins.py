"""The compiled row path (applier._rowpath) and its pure-Python twins give the same results and errors.

Same bytes in, same messages, frames and COPY data out, and for bad bytes the
same ``DecodeError`` text. Valid messages come from the protocol-documentation
encoder of test_fuzz; bad ones are its messages cut short, lengthened, with a
byte changed, or arbitrary bytes. The compiled module must be built where CI
runs (``.ci/run`` checks ``applier --version``); elsewhere these tests skip.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.decoder import messages as m
from applier.decoder.framing import read_frame_pure
from applier.decoder.pgoutput import DecodeError, Decoder, fast_decode_pure
from applier.source.walsender import read_decoded_pure
from applier.targets.base import SQLITE, Binding
from applier.targets.postgres.target import copy_binary_pure, copy_data_pure
from tests.decoder.test_fuzz import SETTINGS, encode, i64, lsns, times, u64, valid_messages

compiled = pytest.importorskip("applier._rowpath", reason="the compiled row path is not built here")


def outcome(fast: Any, items: list[bytes], in_stream: bool = False) -> list[Any]:
    """What one Decoder using ``fast`` makes of a sequence (starting inside a stream block when
    ``in_stream``): each message or the text of its error."""
    dec = Decoder(fast=fast)
    dec.in_stream = in_stream
    out: list[Any] = []
    for data in items:
        try:
            out.append(dec.decode(data))
        except DecodeError as exc:
            out.append(("DecodeError", str(exc)))
    return out


def same_decoding(items: list[bytes], in_stream: bool = False) -> None:
    pure, comp = outcome(fast_decode_pure, items, in_stream), outcome(compiled.fast_decode, items, in_stream)
    assert comp == pure
    for a, b in zip(comp, pure, strict=True):  # the same classes too (equal tuples of other classes compare equal)
        assert type(a) is type(b)
        for x, y in zip(a, b, strict=True):
            assert type(x) is type(y)


def variants(data: bytes, draw: st.DrawFn) -> list[bytes]:
    """The message, every prefix, one changed byte, bytes appended."""
    out = [data[:cut] for cut in range(len(data) + 1)]
    if data:
        i = draw(st.integers(0, len(data) - 1))
        out.append(data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:])
    out.append(data + draw(st.binary(min_size=1, max_size=8)))
    return out


@SETTINGS
@given(valid_messages, st.data())
def test_messages_and_errors_are_the_same_on_both_paths(case: tuple[Any, bool], data: st.DataObject) -> None:
    msg, in_stream = case
    for item in variants(encode(msg), data.draw):
        same_decoding([item], in_stream)
        same_decoding([item], not in_stream)


@SETTINGS
@given(st.lists(st.one_of(valid_messages.map(lambda c: encode(c[0])), st.binary(max_size=24)), max_size=12))
def test_sequences_decode_the_same_on_both_paths(items: list[bytes]) -> None:
    same_decoding(items)


@SETTINGS
@given(st.sampled_from(b"IUDBC"), st.binary(max_size=48))
def test_arbitrary_bytes_after_a_change_kind(kind: int, rest: bytes) -> None:
    same_decoding([bytes([kind]) + rest])


def test_wide_tuples_and_every_column_kind() -> None:
    # more than the 64 columns the compiled reader keeps its kinds on the stack for, and each kind
    for n in (0, 1, 63, 64, 65, 1600):
        kinds = bytes([m.TEXT, m.NULL, m.UNCHANGED_TOAST, m.BINARY][i % 4] for i in range(n))
        vals = tuple(b"v%d\t\\" % i if k in (m.TEXT, m.BINARY) else None for i, k in enumerate(kinds))
        t = m.TupleData(kinds, vals)
        msgs = [m.Insert(None, 7, t), m.Update(None, 7, "O", t, t), m.Update(None, 7, None, None, t),
                m.Delete(None, 7, "K", t)]
        items = [encode(x) for x in msgs]
        same_decoding(items)
        assert outcome(compiled.fast_decode, items) == msgs
        streamed = [x._replace(xid=4_000_000_000) for x in msgs]  # inside a stream block: with the subxact's xid
        items = [encode(x) for x in streamed]
        same_decoding(items, True)
        assert outcome(compiled.fast_decode, items, True) == streamed


def frame_outcome(data: bytes) -> Any:
    try:
        return read_frame_pure(data)
    except DecodeError as exc:
        return ("DecodeError", str(exc))


@SETTINGS
@given(lsns, lsns, times, st.binary(max_size=40), st.data())
def test_frames_are_the_same_on_both_paths(start: int, end: int, ts: int, payload: bytes, data: st.DataObject) -> None:
    w = b"w" + u64(start) + u64(end) + i64(ts) + payload
    k = b"k" + u64(end) + i64(ts) + bytes([data.draw(st.integers(0, 2))])
    for frame in [w, k]:
        for item in [*variants(frame, data.draw), memoryview(frame)]:
            got = compiled.read_frame(item)
            want = frame_outcome(bytes(item))
            if got is None:  # the twin's: every frame the compiled reader does not take must be an error there
                assert isinstance(want, tuple) and want[0] == "DecodeError", item
            else:
                assert got == want and type(got) is type(want)
                assert [type(x) for x in got] == [type(x) for x in want]


def chunk_outcome(read_decoded: Any, frames: list[tuple[int, bytes]], in_stream: bool, most: int, limit: int,
                  fast: Any) -> Any:
    """What ``read_decoded`` takes of what libpq holds (``frames``, each as ``get_copy_data(1)`` returns it, then
    (0, b"") for ever: nothing more at hand): its result, the chunk it filled, what is left."""
    held = list(frames)
    buf: list[Any] = [("earlier", None)]

    def get_copy_data(_: int) -> tuple[int, Any]:
        return held.pop(0) if held else (0, b"")

    return read_decoded(get_copy_data, fast, in_stream, buf, most, limit, 7), buf, held


@SETTINGS
@given(st.lists(st.one_of(valid_messages.map(lambda c: (encode(c[0]), c[1])),
                          st.tuples(st.binary(max_size=30), st.booleans())), max_size=12),
       st.integers(0, 3), st.booleans(), st.integers(1, 14), st.integers(1, 400), st.data())
def test_a_chunk_of_frames_is_read_the_same_on_both_paths(payloads: list[tuple[bytes, bool]], odd: int,
                                                          in_stream: bool, most: int, limit: int,
                                                          data: st.DataObject) -> None:
    frames: list[tuple[int, Any]] = []
    for n, (payload, _) in enumerate(payloads):
        w = b"w" + u64(n) + u64(1000 + n) + i64(n) + payload
        frames.append((len(w), memoryview(w) if n % 2 else w))
    at = data.draw(st.integers(0, len(frames)))  # something else among the frames
    other = [None, (-1, b""), (18, b"k" + u64(5) + i64(6) + b"\x01"), (5, b"wxyz!")][odd]
    if other is not None:
        frames.insert(at, other)
    for fast in (fast_decode_pure, compiled.fast_decode):
        want = chunk_outcome(read_decoded_pure, frames, in_stream, most, limit, fast)
        got = chunk_outcome(compiled.read_decoded, frames, in_stream, most, limit, fast)
        assert got == want  # a frame neither can read (b"wxyz!") is left to ``read``, which raises
        res, buf, _ = got
        assert len(buf) <= max(most, 1) and (res[3] is None) == (len(buf) >= most or res[0] >= limit)


_value = st.one_of(st.none(), st.binary(max_size=12), st.sampled_from([b"\\", b"\t", b"\n", b"\r", b"\\N", b""]))
# rows of one table: every row has the same number of values
rows_strategy = st.integers(0, 6).flatmap(
    lambda width: st.lists(st.lists(_value, min_size=width, max_size=width), max_size=8))


@SETTINGS
@given(rows_strategy)
def test_copy_data_is_the_same_on_both_paths(rows: list[list[bytes | None]]) -> None:
    assert compiled.copy_data(rows) == copy_data_pure(rows)
    assert compiled.copy_data(tuple(r) for r in rows) == copy_data_pure(tuple(r) for r in rows)


def test_copy_data_refuses_what_is_not_bytes() -> None:
    with pytest.raises(TypeError):
        compiled.copy_data([[b"a", "text"]])
    with pytest.raises(TypeError):
        copy_data_pure([[b"a", "text"]])  # type: ignore[list-item]


def _conv_strategy() -> st.SearchStrategy[Any]:
    return st.sampled_from([None, bytes.decode, len, bytes.hex, lambda v: int(v)])  # int(v) fails on most bytes


@SETTINGS
@given(st.integers(0, 5).flatmap(lambda w: st.tuples(
    st.lists(_conv_strategy(), min_size=w, max_size=w),
    st.lists(st.lists(st.one_of(st.none(), st.binary(max_size=6), st.sampled_from([b"12", b"-7"])),
                      min_size=w, max_size=w), max_size=6),
    st.sets(st.integers(0, max(w - 1, 0)), max_size=w).map(sorted) if w else st.just([]))))  # columns, in order
def test_value_rows_are_the_same_on_both_paths(case: tuple[list[Any], list[list[bytes | None]], list[int]]) -> None:
    convert, rows, idx = case
    tuples = [m.TupleData(bytes(m.NULL if v is None else m.TEXT for v in r), tuple(r)) for r in rows]
    rel = m.Relation(None, 1, "public", "t", "d", tuple(m.Column(0, f"c{i}", 25, -1) for i in range(len(convert))))
    binding = Binding(rel, "t", '"t"', convert, SQLITE)  # its ``values`` is the twin, one row at a time

    def pure() -> Any:
        return [tuple(binding.values(t, idx)) for t in tuples]

    def outcome(fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the same exception type either way
            return type(exc)

    assert outcome(lambda: compiled.value_rows(convert, tuples, idx)) == outcome(pure)


@SETTINGS
@given(st.integers(0, 5).flatmap(lambda w: st.lists(
    st.lists(st.one_of(st.none(), st.binary(max_size=300)), min_size=w, max_size=w), max_size=6)),
       st.sampled_from([None, m.TEXT, m.UNCHANGED_TOAST]))
def test_copy_binary_is_the_same_on_both_paths(rows: list[list[bytes | None]], odd: int | None) -> None:
    tuples = [m.TupleData(bytes(m.NULL if v is None else m.BINARY for v in r), tuple(r)) for r in rows]
    if odd is not None and tuples and tuples[-1].kinds:  # a text or unchanged value: both refuse it alike
        last = tuples[-1]
        tuples[-1] = m.TupleData(bytes([odd]) + last.kinds[1:], (b"x" if odd == m.TEXT else None, *last.values[1:]))

    def outcome(fn: Any) -> Any:
        try:
            return fn(tuples)
        except ValueError as exc:
            return str(exc)

    assert outcome(compiled.copy_binary) == outcome(copy_binary_pure)
