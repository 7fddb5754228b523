# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled row path: C twins of the pure-Python functions every change goes through.

Chosen by ``applier._cmodule`` (``APPLIER_PURE_PYTHON=1`` turns it off). Each
function has a pure-Python twin with the same contract; the twin stays the
reference and the tests run both (tests/decoder/test_twins.py and the end-to-end
differential test):

- ``read_frame(data)``: ``applier.decoder.framing.read_frame_pure``;
- ``read_decoded(…)``: ``applier.source.walsender.read_decoded_pure`` (a chunk of frames in one call);
- ``fast_decode(data)``: ``applier.decoder.pgoutput.fast_decode_pure``;
- ``copy_data(rows)``: ``applier.targets.postgres.target.copy_data_pure``;
- ``copy_binary(rows)``: ``applier.targets.postgres.target.copy_binary_pure``;
- ``value_rows(convert, rows, idx)``: ``applier.targets.base.Binding.values``, row by row.

NOTES
- Decoding functions return None for anything they do not fully recognise
  (another kind, bad bytes, a short buffer): the caller then runs the
  field-checking pure reader, which decodes it or raises the ``DecodeError``
  naming message, field and byte offset. So both paths give the same message
  for good bytes and the same error for bad ones, and the error text is written
  once, in Python.
- Every read of wire bytes is bounds-checked against the buffer's length before it
  happens; objects handed in (rows, tuples) are checked for their type and size.
- The twins agree on everything the decoder makes (bytes values, TupleData rows);
  on anything else both raise, the same exception class, not always the same text.
- Objects returned are the same NamedTuples the pure path builds, made as
  ``tuple.__new__`` makes them (the type's allocation, then the items; their
  Python ``__new__`` is skipped, as the pure path skips it).
"""

from cpython.object cimport PyTypeObject
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy


cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t n)

from applier.decoder import messages
from applier.lsn import LSN

# The message classes, bound at import: applier.decoder.messages and applier.lsn import nothing that imports
# this module (applier.decoder's __init__ imports none of its modules; pgoutput and framing import this one
# through applier._cmodule).
cdef object _new_int = int.__new__
cdef object _Begin = messages.Begin
cdef object _Commit = messages.Commit
cdef object _Insert = messages.Insert
cdef object _Update = messages.Update
cdef object _Delete = messages.Delete
cdef object _TupleData = messages.TupleData
cdef object _XLogData = messages.XLogData
cdef object _Keepalive = messages.Keepalive
cdef object _LSN = LSN


cdef object _K = "K"
cdef object _O = "O"
cdef dict _all_text = {}  # column count -> b"t" * count


cdef inline uint64_t _u64(const uint8_t* p) noexcept nogil:
    return ((<uint64_t>p[0] << 56) | (<uint64_t>p[1] << 48) | (<uint64_t>p[2] << 40) | (<uint64_t>p[3] << 32)
            | (<uint64_t>p[4] << 24) | (<uint64_t>p[5] << 16) | (<uint64_t>p[6] << 8) | <uint64_t>p[7])


cdef inline uint32_t _u32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3]


cdef inline int16_t _i16(const uint8_t* p) noexcept nogil:
    return <int16_t>((<uint32_t>p[0] << 8) | <uint32_t>p[1])


cdef inline void _put(object t, Py_ssize_t i, object v):
    Py_INCREF(v)
    PyTuple_SET_ITEM(t, i, v)


cdef inline object _nt2(object cls, object a, object b):
    """An instance of the NamedTuple ``cls`` (a tuple subtype without fields of its own), as tuple.__new__ makes it."""
    cdef object t = PyType_GenericAlloc(<PyTypeObject*>cls, 2)
    _put(t, 0, a)
    _put(t, 1, b)
    return t


cdef inline object _nt3(object cls, object a, object b, object c):
    cdef object t = PyType_GenericAlloc(<PyTypeObject*>cls, 3)
    _put(t, 0, a)
    _put(t, 1, b)
    _put(t, 2, c)
    return t


cdef inline object _nt4(object cls, object a, object b, object c, object d):
    cdef object t = PyType_GenericAlloc(<PyTypeObject*>cls, 4)
    _put(t, 0, a)
    _put(t, 1, b)
    _put(t, 2, c)
    _put(t, 3, d)
    return t


cdef inline object _nt5(object cls, object a, object b, object c, object d, object e):
    cdef object t = PyType_GenericAlloc(<PyTypeObject*>cls, 5)
    _put(t, 0, a)
    _put(t, 1, b)
    _put(t, 2, c)
    _put(t, 3, d)
    _put(t, 4, e)
    return t


# -- frames ----------------------------------------------------------------------------------------

def read_frame(data):
    """An XLogData or Keepalive frame from a CopyData payload (bytes or a buffer); None: anything else."""
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef Py_ssize_t n
    cdef uint8_t reply
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        n = view.len
        if n >= 25 and p[0] == 0x77:  # 'w'
            return _nt4(_XLogData, _u64(p + 1), _u64(p + 9), <int64_t>_u64(p + 17),
                         PyBytes_FromStringAndSize(<const char*>p + 25, n - 25))
        if n == 18 and p[0] == 0x6B:  # 'k'
            reply = p[17]
            if reply > 1:
                return None
            return _nt3(_Keepalive, _new_int(_LSN, _u64(p + 1)), <int64_t>_u64(p + 9), reply == 1)
        return None
    finally:
        PyBuffer_Release(&view)


def read_decoded(get_copy_data, fast, bint in_stream, list buf, Py_ssize_t most, Py_ssize_t limit,
                 Py_ssize_t size):
    """Take what libpq already holds while it is XLogData whose message ``fast`` decodes, appending
    (frame, message) to ``buf`` until it holds ``most`` frames or ``size`` (its payload bytes) reaches ``limit``;
    (size, frames taken, highest WAL end taken (0: none), ``get_copy_data(1)``'s (nbytes, data) of the frame not
    taken (None: the chunk is full)). Twin: ``applier.source.walsender.read_decoded_pure``."""
    cdef Py_ssize_t taken = 0
    cdef uint64_t top = 0
    cdef uint64_t end
    cdef object got, frame, msg, payload
    while len(buf) < most and size < limit:
        got = get_copy_data(1)
        if type(got) is not tuple or len(<tuple>got) != 2:
            raise TypeError(f"get_copy_data returned {type(got).__name__}, not (nbytes, data)")
        if (<tuple>got)[0] <= 0:
            return size, taken, top, got
        frame = read_frame((<tuple>got)[1])
        if frame is None or type(frame) is not _XLogData:
            return size, taken, top, got
        payload = (<tuple>frame)[3]
        msg = fast(payload, in_stream)
        if msg is None:
            return size, taken, top, got
        end = (<tuple>frame)[1]
        if end > top:
            top = end
        buf.append((frame, msg))
        size += PyBytes_GET_SIZE(payload)
        taken += 1
    return size, taken, top, None


# -- pgoutput changes ------------------------------------------------------------------------------

cdef object _tuple(const uint8_t* buf, Py_ssize_t* pos, Py_ssize_t end):
    """TupleData at ``pos[0]`` (advanced past it); None when the bytes are not one."""
    cdef Py_ssize_t p = pos[0]
    cdef int16_t ncols
    cdef Py_ssize_t i
    cdef uint8_t kind
    cdef int32_t n
    cdef bint plain = True
    cdef object values, v, kinds
    cdef char small[64]
    cdef char* kb
    if p + 2 > end:
        return None
    ncols = _i16(buf + p)
    if ncols < 0:
        return None
    p += 2
    values = PyTuple_New(ncols)
    if ncols <= 64:
        kb = &small[0]
    else:
        kb = <char*>malloc(ncols)
        if kb == NULL:
            raise MemoryError()
    try:
        for i in range(ncols):
            if p >= end:
                return None
            kind = buf[p]
            kb[i] = <char>kind
            p += 1
            if kind == 0x74 or kind == 0x62:  # 't', 'b'
                if p + 4 > end:
                    return None
                n = <int32_t>_u32(buf + p)
                p += 4
                if n < 0 or p + n > end:
                    return None
                v = PyBytes_FromStringAndSize(<const char*>buf + p, n)
                p += n
                if kind == 0x62:
                    plain = False
            elif kind == 0x6E or kind == 0x75:  # 'n', 'u'
                v = None
                plain = False
            else:
                return None
            Py_INCREF(v)
            PyTuple_SET_ITEM(values, i, v)
        if plain:
            kinds = _all_text.get(ncols)
            if kinds is None:
                kinds = _all_text[ncols] = b"t" * ncols
        else:
            kinds = PyBytes_FromStringAndSize(kb, ncols)
    finally:
        if kb != &small[0]:
            free(kb)
    pos[0] = p
    return _nt2(_TupleData, kinds, values)


# The message kinds below are C integer constants (0x49 'I' …) that mirror applier.decoder.messages.MessageKind
# (INSERT, UPDATE, DELETE, BEGIN, COMMIT): this is the decoder's fast path compiled, the one place outside
# applier/decoder/ that spells them (tests/test_layout.py); tests/decoder/test_twins.py runs both paths on every kind.
def fast_decode(data, bint in_stream=False):
    """Insert, Update or Delete (with the streamed xid ``in_stream``), or Begin or Commit outside a stream,
    from one message's bytes; None: anything else."""
    cdef bytes b = data if type(data) is bytes else bytes(data)
    cdef const uint8_t* buf = <const uint8_t*>PyBytes_AS_STRING(b)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(b)
    cdef Py_ssize_t pos, at
    cdef uint8_t kind, part
    cdef object oid, old, new, xid = None
    if end < 1:
        return None
    kind = buf[0]
    if kind == 0x49 or kind == 0x55 or kind == 0x44:  # 'I', 'U', 'D'
        at = 5 if in_stream else 1  # where the relation OID is: after the xid inside a stream
        if end < at + 7:
            return None
        if in_stream:
            xid = _u32(buf + 1)
        oid = _u32(buf + at)
        part = buf[at + 4]
        pos = at + 5
        if kind == 0x49:
            if part != 0x4E:  # 'N'
                return None
            new = _tuple(buf, &pos, end)
            if new is None or pos != end:
                return None
            return _nt3(_Insert, xid, oid, new)
        if part == 0x4E and kind == 0x55:
            new = _tuple(buf, &pos, end)
            if new is None or pos != end:
                return None
            return _nt5(_Update, xid, oid, None, None, new)
        if part != 0x4B and part != 0x4F:  # 'K', 'O'
            return None
        old = _tuple(buf, &pos, end)
        if old is None:
            return None
        if kind == 0x44:
            if pos != end:
                return None
            return _nt4(_Delete, xid, oid, _K if part == 0x4B else _O, old)
        if pos >= end or buf[pos] != 0x4E:
            return None
        pos += 1
        new = _tuple(buf, &pos, end)
        if new is None or pos != end:
            return None
        return _nt5(_Update, xid, oid, _K if part == 0x4B else _O, old, new)
    if in_stream:
        return None
    if kind == 0x42 and end == 21:  # 'B': final_lsn, commit_time, xid
        return _nt3(_Begin, _new_int(_LSN, _u64(buf + 1)), <int64_t>_u64(buf + 9), _u32(buf + 17))
    if kind == 0x43 and end == 26:  # 'C': flags, commit_lsn, end_lsn, commit_time
        return _nt4(_Commit, buf[1], _new_int(_LSN, _u64(buf + 2)), _new_int(_LSN, _u64(buf + 10)),
                    <int64_t>_u64(buf + 18))
    return None


# -- COPY text -------------------------------------------------------------------------------------

cdef struct _Out:
    char* buf
    Py_ssize_t len
    Py_ssize_t cap


cdef int _reserve(_Out* o, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef char* nb
    if o.len + more <= o.cap:
        return 0
    cap = o.cap * 2 if o.cap else 65536
    while cap < o.len + more:
        cap *= 2
    nb = <char*>realloc(o.buf, cap)
    if nb == NULL:
        raise MemoryError()
    o.buf = nb
    o.cap = cap
    return 0


def copy_data(rows):
    """COPY text-format data for rows of wire text values (None: NULL), each line ending in a newline."""
    cdef _Out o
    cdef object row, seq, v
    cdef Py_ssize_t i, ncols, n, j
    cdef const char* s
    cdef char c
    o.buf = NULL
    o.len = 0
    o.cap = 0
    try:
        for row in rows:
            seq = PySequence_Fast(row, "a COPY row must be a sequence")
            ncols = PySequence_Fast_GET_SIZE(seq)
            for i in range(ncols):
                v = <object>PySequence_Fast_GET_ITEM(seq, i)
                if i:
                    _reserve(&o, 1)
                    o.buf[o.len] = b'\t'
                    o.len += 1
                if v is None:
                    _reserve(&o, 2)
                    o.buf[o.len] = b'\\'
                    o.buf[o.len + 1] = b'N'
                    o.len += 2
                    continue
                if type(v) is not bytes:
                    raise TypeError(f"a COPY value must be bytes or None, not {type(v).__name__}")
                s = PyBytes_AS_STRING(v)
                n = PyBytes_GET_SIZE(v)
                _reserve(&o, 2 * n)
                for j in range(n):
                    c = s[j]
                    if c == b'\\' or c == b'\n' or c == b'\r' or c == b'\t':
                        o.buf[o.len] = b'\\'
                        o.buf[o.len + 1] = (b'\\' if c == b'\\' else b'n' if c == b'\n'
                                            else b'r' if c == b'\r' else b't')
                        o.len += 2
                    else:
                        o.buf[o.len] = c
                        o.len += 1
            _reserve(&o, 1)
            o.buf[o.len] = b'\n'
            o.len += 1
        return PyBytes_FromStringAndSize(o.buf, o.len) if o.len else b""
    finally:
        free(o.buf)


# -- driver parameters -----------------------------------------------------------------------------

def value_rows(convert, rows, idx):
    """Driver parameters (a tuple per row) for the columns ``idx`` of each TupleData of ``rows``, each value
    through ``convert[i]`` (None: the bytes as they are); NULL stays None."""
    cdef list conv = list(convert)
    cdef tuple cols = tuple(idx)
    cdef Py_ssize_t n = len(cols)
    cdef Py_ssize_t j
    cdef list out = []
    cdef object t, vals, v, c, row
    for t in rows:
        vals = t[1]  # TupleData.values
        row = PyTuple_New(n)
        for j in range(n):
            v = vals[cols[j]]
            if v is not None:
                c = conv[cols[j]]
                if c is not None:
                    v = c(v)
            _put(row, j, v)
        out.append(row)
    return out


# -- COPY binary -----------------------------------------------------------------------------------

def copy_binary(rows):
    """COPY binary-format tuples (no signature, no trailer) for TupleData rows whose every value is binary
    (kind ``b``) or NULL: pgoutput's binary field layout is COPY's (Int32 length, then the bytes)."""
    cdef _Out o
    cdef object t
    cdef bytes kinds, v
    cdef tuple vals
    cdef const char* kb
    cdef Py_ssize_t ncols, i, n
    o.buf = NULL
    o.len = 0
    o.cap = 0
    try:
        for t in rows:
            kinds = t[0]
            vals = t[1]
            ncols = PyBytes_GET_SIZE(kinds)
            if len(vals) != ncols:
                raise ValueError(f"a row has {ncols} column kinds but {len(vals)} values")
            kb = PyBytes_AS_STRING(kinds)
            _reserve(&o, 2)
            o.buf[o.len] = <char>((ncols >> 8) & 0xFF)
            o.buf[o.len + 1] = <char>(ncols & 0xFF)
            o.len += 2
            for i in range(ncols):
                if kb[i] == b'n':
                    _reserve(&o, 4)
                    memcpy(o.buf + o.len, b"\xff\xff\xff\xff", 4)
                    o.len += 4
                elif kb[i] == b'b' and vals[i] is not None:
                    v = vals[i]
                    n = PyBytes_GET_SIZE(v)
                    _reserve(&o, 4 + n)
                    o.buf[o.len] = <char>((n >> 24) & 0xFF)
                    o.buf[o.len + 1] = <char>((n >> 16) & 0xFF)
                    o.buf[o.len + 2] = <char>((n >> 8) & 0xFF)
                    o.buf[o.len + 3] = <char>(n & 0xFF)
                    memcpy(o.buf + o.len + 4, PyBytes_AS_STRING(v), n)
                    o.len += 4 + n
                else:
                    raise ValueError(f"column {i + 1} is not a binary value or NULL (kind {chr(kb[i])!r})")
        return PyBytes_FromStringAndSize(o.buf, o.len) if o.len else b""
    finally:
        free(o.buf)
